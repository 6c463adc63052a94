"""Copy contiguous K/V rows to and from vLLM's paged KV cache, per attention backend.

A token's *slot* is ``block_id * block_size + offset`` in the scheduler's blocks.

* :mod:`.device`: CUDA (FLASH_ATTN, FLASHINFER, TRITON_ATTN) and Ascend caches, written and read
  through K/V views ``[NB, BS, H, D]`` with the op registry's ``paged_kv_write``/``paged_kv_read``
  (:class:`DeviceLayout`).
* :mod:`.choice`: which of those forms the engine handed over (:func:`layout_for`), or a
  one-line refusal.
* :mod:`.cpu`: vLLM's CPU cache, written through vLLM's own op and read through a map derived
  from it (:class:`CpuLayout`); :mod:`.cpu_attention`: vLLM's CPU paged attention.
"""

from lmcache_backend.integration.vllm.layouts.base import LayerCache, PagedLayout, slots_for
from lmcache_backend.integration.vllm.layouts.choice import (
    SUPPORTED,
    UnsupportedKVCache,
    backend_name_of,
    layout_for,
)
from lmcache_backend.integration.vllm.layouts.cpu import (
    CpuBlockMap,
    CpuLayout,
    derive_cpu_block_map,
)
from lmcache_backend.integration.vllm.layouts.cpu_attention import AttentionPlan, CpuAttention
from lmcache_backend.integration.vllm.layouts.device import CacheForm, DeviceLayout

__all__ = [
    "SUPPORTED",
    "AttentionPlan",
    "CacheForm",
    "CpuAttention",
    "CpuBlockMap",
    "CpuLayout",
    "DeviceLayout",
    "LayerCache",
    "PagedLayout",
    "UnsupportedKVCache",
    "backend_name_of",
    "derive_cpu_block_map",
    "layout_for",
    "slots_for",
]
