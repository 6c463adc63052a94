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

from collections.abc import Callable

from lmcache_backend.backends.ascend.attention import (
    attention_at_positions,
    verify_attention_at_positions,
)
from lmcache_backend.backends.ascend.deviation import kv_deviation_topk
from lmcache_backend.backends.ascend.paged_kv import (
    paged_kv_read,
    paged_kv_write,
    verify_paged_kv_read,
    verify_paged_kv_write,
)
from lmcache_backend.backends.ascend.rope import rope_rerotate_k, verify_rope_rerotate_k
from lmcache_backend.backends.ascend.rows import (
    gather_rows,
    scatter_rows,
    verify_gather_rows,
    verify_scatter_rows,
)
from lmcache_backend.ops import BackendUnavailable, device

OPS: dict[str, Callable] = {
    "rope_rerotate_k": rope_rerotate_k,
    "kv_deviation_topk": kv_deviation_topk,
    "gather_rows": gather_rows,
    "scatter_rows": scatter_rows,
    "attention_at_positions": attention_at_positions,
    "paged_kv_write": paged_kv_write,
    "paged_kv_read": paged_kv_read,
}

# A verifier returns a reason to send a call to the torch reference instead (tensors not on an
# NPU, or a dtype/shape the fused operator does not take), else None.
VERIFIERS: dict[str, Callable[..., str | None]] = {
    "rope_rerotate_k": verify_rope_rerotate_k,
    "gather_rows": verify_gather_rows,
    "scatter_rows": verify_scatter_rows,
    "attention_at_positions": verify_attention_at_positions,
    "paged_kv_write": verify_paged_kv_write,
    "paged_kv_read": verify_paged_kv_read,
}


def load() -> dict[str, Callable]:
    """Return the ops this backend implements.

    Raises:
        BackendUnavailable: no usable NPU here; the message says what is missing
            (torch_npu not installed, CANN import failure, or no visible device).
    """
    reason = device.npu_unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(reason)
    return dict(OPS)


__all__ = ["OPS", "VERIFIERS", "load", *OPS]
