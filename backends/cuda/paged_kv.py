"""Copies between contiguous K/V rows and vLLM's paged KV cache through a slot mapping.

Layout (vLLM's CUDA flash-attention backend): one layer's ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, Hkv, D]``; slot ``s`` is row ``s % block_size`` of block
``s // block_size``. K and V move in the same program, so the slot is read once for both. Cache
strides are taken as given, so a cache that is a view of a larger allocation works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmcache_backend.ops import register

from ._common import FLOAT_DTYPES, device_of, device_reason, index_reason, next_pow2

_ELEMENTS_PER_PROGRAM = 4096
_MAX_BLOCK_FEATURES = 1024


def _blocks(num_tokens: int, num_features: int) -> tuple[int, int]:
    block_f = min(next_pow2(num_features), _MAX_BLOCK_FEATURES)
    block_t = min(max(_ELEMENTS_PER_PROGRAM // block_f, 1), next_pow2(num_tokens))
    return block_t, block_f


@triton.jit
def _paged_kv_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_tokens,
    num_features,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    feats = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    tok_mask = toks < num_tokens
    slot = tl.load(slot_ptr + toks, mask=tok_mask, other=-1).to(tl.int64)
    # A negative slot is vLLM's padding: nothing to write for that token.
    mask = (tok_mask & (slot >= 0))[:, None] & (feats < num_features)[None, :]
    # int64: a head stride can be large (vLLM 0.29+'s LHBNC puts heads outside blocks), and
    # head * stride in int32 would wrap
    head = (feats // HEAD_DIM).to(tl.int64)[None, :]
    dim = (feats % HEAD_DIM)[None, :]
    blk = (slot // block_size)[:, None]
    row = (slot % block_size)[:, None]
    toks64 = toks.to(tl.int64)[:, None]

    k = tl.load(key_ptr + toks64 * stride_kt + head * stride_kh + dim, mask=mask)
    kc = key_cache_ptr + blk * stride_kc_block + row * stride_kc_slot + head * stride_kc_head + dim
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + toks64 * stride_vt + head * stride_vh + dim, mask=mask)
    vc = (
        value_cache_ptr + blk * stride_vc_block + row * stride_vc_slot + head * stride_vc_head + dim
    )
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_kv_read_kernel(
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    key_ptr,
    value_ptr,
    num_tokens,
    num_features,
    block_size,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    feats = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    tok_mask = toks < num_tokens
    slot = tl.load(slot_ptr + toks, mask=tok_mask, other=0).to(tl.int64)
    mask = tok_mask[:, None] & (feats < num_features)[None, :]
    # int64: a head stride can be large (vLLM 0.29+'s LHBNC puts heads outside blocks), and
    # head * stride in int32 would wrap
    head = (feats // HEAD_DIM).to(tl.int64)[None, :]
    dim = (feats % HEAD_DIM)[None, :]
    blk = (slot // block_size)[:, None]
    row = (slot % block_size)[:, None]
    # Outputs are fresh contiguous [T, H*D] tensors.
    out_off = toks.to(tl.int64)[:, None] * num_features + feats[None, :]

    kc = key_cache_ptr + blk * stride_kc_block + row * stride_kc_slot + head * stride_kc_head + dim
    tl.store(key_ptr + out_off, tl.load(kc, mask=mask), mask=mask)
    vc = (
        value_cache_ptr + blk * stride_vc_block + row * stride_vc_slot + head * stride_vc_head + dim
    )
    tl.store(value_ptr + out_off, tl.load(vc, mask=mask), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def paged_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write contiguous K/V rows into a paged cache, in place.

    Args:
        key, value: ``[T, Hkv, D]`` fp32/fp16/bf16, any strides; cast to the cache dtype.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` fp32/fp16/bf16 with a
            contiguous last dim (other strides free).
        slot_mapping: ``[T]`` int32/int64 slots below ``num_blocks * block_size``; a negative
            slot (vLLM's padding) is skipped.
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0 or num_heads * head_dim == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    slots = slot_mapping.to(device=key.device).contiguous()
    num_features = num_heads * head_dim
    block_t, block_f = _blocks(num_tokens, num_features)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_features, block_f))
    with device_of(key):
        _paged_kv_write_kernel[grid](
            key,
            value,
            key_cache,
            value_cache,
            slots,
            num_tokens,
            num_features,
            key_cache.shape[1],
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            HEAD_DIM=head_dim,
            BLOCK_T=block_t,
            BLOCK_F=block_f,
            num_warps=4,
        )


def paged_kv_read(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K/V rows from a paged cache laid out as in :func:`paged_kv_write`.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous last dim.
        slot_mapping: ``[T]`` int32/int64, every slot in ``[0, num_blocks * block_size)``.
        out: optional ``(key, value)`` contiguous ``[T, Hkv, D]`` tensors in the cache dtypes
            to write into.

    Returns:
        ``(key, value)``, each ``[T, Hkv, D]`` contiguous in the cache dtype (``out`` when given).

    Raises:
        ValueError: a slot is negative (padding), as in the reference. Checking costs one
            device-to-host sync.
    """
    _, block_size, num_heads, head_dim = key_cache.shape
    slots = slot_mapping.to(device=key_cache.device).contiguous()
    num_tokens = slots.shape[0]
    shape = (num_tokens, num_heads, head_dim)
    if out is None:
        key = torch.empty(shape, dtype=key_cache.dtype, device=slots.device)
        value = torch.empty(shape, dtype=value_cache.dtype, device=slots.device)
    else:
        key, value = out
        for t, cache in ((key, key_cache), (value, value_cache)):
            if t.shape != shape or t.dtype != cache.dtype or not t.is_contiguous():
                raise ValueError(f"paged_kv_read: out must be contiguous {cache.dtype} {shape}")
    if num_tokens == 0 or num_heads * head_dim == 0:
        return key, value
    if bool((slots < 0).any()):
        raise ValueError("paged_kv_read: slot_mapping holds negative (padding) slots")
    num_features = num_heads * head_dim
    block_t, block_f = _blocks(num_tokens, num_features)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_features, block_f))
    with device_of(key_cache):
        _paged_kv_read_kernel[grid](
            key_cache,
            value_cache,
            slots,
            key,
            value,
            num_tokens,
            num_features,
            block_size,
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            HEAD_DIM=head_dim,
            BLOCK_T=block_t,
            BLOCK_F=block_f,
            num_warps=4,
        )
    return key, value


def _cache_reason(key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        return (
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} are not one "
            "[num_blocks, block_size, Hkv, D] shape"
        )
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in FLOAT_DTYPES:
            return f"{name} dtype {t.dtype} not in fp32/fp16/bf16 (quantized caches need scales)"
        if t.stride(-1) != 1:
            return f"{name} last dim is not contiguous"
    return None


def verify_paged_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it."""
    reason = _cache_reason(key_cache, value_cache)
    if reason:
        return reason
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != key_cache.shape[2:]:
        return (
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match "
            f"[T, *{tuple(key_cache.shape[2:])}]"
        )
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in FLOAT_DTYPES:
            return f"{name} dtype {t.dtype} not in fp32/fp16/bf16"
    reason = index_reason("slot_mapping", slot_mapping, key.shape[0])
    if reason:
        return reason
    return device_reason(key, value, key_cache, value_cache)


def verify_paged_kv_read(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it."""
    reason = _cache_reason(key_cache, value_cache) or index_reason("slot_mapping", slot_mapping)
    if reason:
        return reason
    return device_reason(key_cache, value_cache)


register("cuda", "paged_kv_write", paged_kv_write, verify_paged_kv_write)
register("cuda", "paged_kv_read", paged_kv_read, verify_paged_kv_read)
