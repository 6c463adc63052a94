"""Copies between contiguous K/V rows and vllm-ascend's paged KV cache.

vllm-ascend (Atlas A2/A3) lays one layer's cache out as ``kv_cache[0]`` = keys and
``kv_cache[1]`` = values, each ``[num_blocks, block_size, num_kv_heads, head_size]`` (ND format);
slot ``s`` is row ``s % block_size`` of block ``s // block_size``. Atlas 300 inference cards
(310P) use a FRACTAL_NZ cache ``[num_blocks, H*D/16, block_size, 16]`` instead; it is refused here.

Writes of fp16/bf16/int8 caches use ``torch_npu._npu_reshape_and_cache`` (the kernel
vllm-ascend writes its cache with); other dtypes use ``torch_npu.npu_scatter_nd_update_`` on the
flat ``[num_blocks * block_size, Hkv, D]`` view. Reads are one ``index_select`` per cache.
"""

from __future__ import annotations

import torch

from lmcache_backend.backends.ascend._npu import npu, on_npu_reason
from lmcache_backend.backends.ascend.rows import SCATTER_DTYPES
from lmcache_backend.ops import register

# Cache dtypes _npu_reshape_and_cache takes; it wants int32 slot indices.
_RESHAPE_AND_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8)


def _check_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            "paged KV cache must be ND [num_blocks, block_size, num_kv_heads, head_size]; got "
            f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)} (FRACTAL_NZ caches of "
            "Atlas 300 inference cards are not supported)"
        )


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, Hkv, D]`` -> ``[num_blocks * block_size, Hkv, D]`` view."""
    return cache.view(-1, *cache.shape[2:])


def paged_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write contiguous K/V rows into vllm-ascend's paged cache, in place.

    Args:
        key, value: ``[T, Hkv, D]`` (cast to the cache dtype).
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` (ND).
        slot_mapping: ``[T]`` int slots; a negative slot (vLLM padding) is skipped.
    """
    _check_layout(key_cache, value_cache)
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int32)
    keep = slots >= 0
    # One host sync; padding is rare, and without it no boolean-mask copy is made.
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    if slots.numel() == 0:
        return
    key = key.to(device=key_cache.device, dtype=key_cache.dtype).contiguous()
    value = value.to(device=value_cache.device, dtype=value_cache.dtype).contiguous()
    ops = npu()
    if key_cache.dtype in _RESHAPE_AND_CACHE_DTYPES and value_cache.dtype == key_cache.dtype:
        ops._npu_reshape_and_cache(
            key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slots
        )
        return
    rows = slots.reshape(-1, 1)
    ops.npu_scatter_nd_update_(_flat(key_cache), rows, key)
    ops.npu_scatter_nd_update_(_flat(value_cache), rows, value)


def paged_kv_read(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K/V rows ``[T, Hkv, D]`` from vllm-ascend's paged cache (every slot non-negative)."""
    _check_layout(key_cache, value_cache)
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    if bool((slots < 0).any()):
        raise ValueError("paged_kv_read: slot_mapping holds negative (padding) slots")
    return _flat(key_cache).index_select(0, slots), _flat(value_cache).index_select(0, slots)


def paged_write_unsupported_reason(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> str | None:
    """Why neither NPU write path can take these caches, or ``None``."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype not in SCATTER_DTYPES:
            return f"{name} dtype {cache.dtype} not supported by the NPU cache writers"
    return None


def verify_paged_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> str | None:
    """Verifier for the op registry."""
    return on_npu_reason(key, value, key_cache, value_cache) or paged_write_unsupported_reason(
        key, value, key_cache, value_cache, slot_mapping
    )


def verify_paged_kv_read(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> str | None:
    """Verifier for the op registry."""
    return on_npu_reason(key_cache, value_cache)


register("ascend", "paged_kv_write", paged_kv_write, verify_paged_kv_write)
register("ascend", "paged_kv_read", paged_kv_read, verify_paged_kv_read)
