"""Ascend backend: the CacheBlend ops on torch-npu (installed as
``lmcache_backend.backends.ascend``).

One module per op family; each calls torch_npu's fused operators through
:func:`lmcache_backend.backends.ascend._npu.npu`, so importing this package never imports
``torch_npu``:

- ``rope``: ``rope_rerotate_k`` -> ``torch_npu.npu_rotary_mul``
- ``deviation``: ``kv_deviation_topk`` -> torch ops (sub, sum, topk, nonzero)
- ``rows``: ``gather_rows`` -> ``index_select``; ``scatter_rows`` ->
  ``torch_npu.npu_scatter_nd_update_``
- ``attention``: ``attention_at_positions`` -> ``torch_npu.npu_fused_infer_attention_score``
  (fp16/bf16) or fp32 torch ops
- ``paged_kv``: ``paged_kv_write`` -> ``torch_npu._npu_reshape_and_cache`` /
  ``npu_scatter_nd_update_``; ``paged_kv_read`` -> ``index_select`` (vllm-ascend ND layout)
"""

from __future__ import annotations

from lmcache_backend import device

# the op modules register their ops when imported; none of them imports torch_npu
from lmcache_backend.backends.ascend import (  # noqa: F401
    attention,
    deviation,
    paged_kv,
    rope,
    rows,
)
from lmcache_backend.ops import BackendUnavailable


def load() -> None:
    """Make the ops available (they registered when this package was imported).

    Raises:
        BackendUnavailable: no usable NPU here; the message says what is missing
            (torch_npu not installed, CANN import failure, or no visible device).
    """
    reason = device.npu_unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(reason)
