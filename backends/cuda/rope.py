"""Fused RoPE re-rotation of cached keys, in place, from old to new positions.

Undoing the rotation at ``p`` and applying it at ``p'`` is one rotation by ``p' - p``; the kernel
builds its cosine and sine from the two table rows with the angle-difference identities, so each
key element is read and written once and no trigonometry runs on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmcache_backend.ops import register

from ._common import device_of, device_reason, float_dtype_reason, index_reason, next_pow2

# Elements of one rotation half handled per program: 64 (token, head) rows of a 64-wide half for
# head_dim 128. Large enough to keep a memory-bound copy busy, small enough for the registers.
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _rope_rerotate_k_kernel(
    k_ptr,
    old_pos_ptr,
    new_pos_ptr,
    cs_ptr,
    num_rows,
    num_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cs_row,
    stride_cs_col,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    # One row is one head of one token; rows are (token, head) pairs flattened.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    tok = (rows // num_heads).to(tl.int64)
    head = (rows % num_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, None] & (cols < HALF)[None, :]

    # int64 so that position * row stride cannot overflow for long-context tables.
    old = tl.load(old_pos_ptr + tok, mask=row_mask, other=0).to(tl.int64)
    new = tl.load(new_pos_ptr + tok, mask=row_mask, other=0).to(tl.int64)
    col_off = cols[None, :] * stride_cs_col
    old_row = cs_ptr + old[:, None] * stride_cs_row + col_off
    new_row = cs_ptr + new[:, None] * stride_cs_row + col_off
    cos_o = tl.load(old_row, mask=mask, other=1.0).to(tl.float32)
    sin_o = tl.load(old_row + HALF * stride_cs_col, mask=mask, other=0.0).to(tl.float32)
    cos_n = tl.load(new_row, mask=mask, other=1.0).to(tl.float32)
    sin_n = tl.load(new_row + HALF * stride_cs_col, mask=mask, other=0.0).to(tl.float32)
    cos_d = cos_n * cos_o + sin_n * sin_o  # cos(new - old)
    sin_d = sin_n * cos_o - cos_n * sin_o  # sin(new - old)

    base = k_ptr + tok[:, None] * stride_kt + head[:, None] * stride_kh
    if IS_NEOX:  # feature i pairs with i + HALF
        p1 = base + cols[None, :] * stride_kd
        p2 = p1 + HALF * stride_kd
    else:  # GPT-J: feature 2i pairs with 2i + 1
        p1 = base + (2 * cols[None, :]) * stride_kd
        p2 = p1 + stride_kd
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    out_ty = k_ptr.dtype.element_ty
    tl.store(p1, (x1 * cos_d - x2 * sin_d).to(out_ty), mask=mask)
    tl.store(p2, (x2 * cos_d + x1 * sin_d).to(out_ty), mask=mask)


def _head_strides(k: torch.Tensor, rot_dim: int) -> tuple[int, int, int, int]:
    """``(num_heads, stride_t, stride_h, stride_d)`` of ``k`` seen as ``[T, H, D]``."""
    if k.dim() == 3:
        return k.shape[1], k.stride(0), k.stride(1), k.stride(2)
    # 2-D [T, H*D]: heads of size rot_dim (the reference's convention when R == D).
    return k.shape[1] // rot_dim, k.stride(0), rot_dim * k.stride(1), k.stride(1)


def rope_rerotate_k(
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """In place: move RoPE-encoded keys from ``old_positions`` to ``new_positions``.

    Args:
        k: ``[T, Hkv*D]`` or ``[T, Hkv, D]``, fp32/fp16/bf16, any strides (a slice of a fused
            QKV tensor works); math in fp32. For the 2-D form the head size is the rotary dim.
        old_positions, new_positions: ``[T]`` int32/int64, each in ``[0, max_pos)``.
        cos_sin_cache: ``[max_pos, R]`` fp32/fp16/bf16, ``R/2`` cosines then ``R/2`` sines
            (vLLM's layout); features of a head beyond ``R`` (partial rotary) are left untouched.
        is_neox: NeoX (split halves) pairing when True, GPT-J (interleaved) when False.

    Returns:
        ``k``, rotated in place.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return k
    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    num_heads, stride_t, stride_h, stride_d = _head_strides(k, rot_dim)
    num_rows = num_tokens * num_heads
    block_half = next_pow2(half)
    block_rows = min(max(_ELEMENTS_PER_PROGRAM // block_half, 1), next_pow2(num_rows))
    grid = (triton.cdiv(num_rows, block_rows),)
    with device_of(k):
        _rope_rerotate_k_kernel[grid](
            k,
            old_positions,
            new_positions,
            cos_sin_cache,
            num_rows,
            num_heads,
            stride_t,
            stride_h,
            stride_d,
            cos_sin_cache.stride(0),
            cos_sin_cache.stride(1),
            HALF=half,
            BLOCK_HALF=block_half,
            BLOCK_ROWS=block_rows,
            IS_NEOX=bool(is_neox),
            num_warps=4,
        )
    return k


def verify_rope_rerotate_k(
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it."""
    if k.dim() not in (2, 3):
        return f"k is {k.dim()}-D, not [T, H*D] or [T, H, D]"
    if cos_sin_cache.dim() != 2:
        return f"cos_sin_cache is {cos_sin_cache.dim()}-D, not [max_pos, R]"
    for name, t in (("k", k), ("cos_sin_cache", cos_sin_cache)):
        reason = float_dtype_reason(name, t)
        if reason:
            return reason
    for name, t in (("old_positions", old_positions), ("new_positions", new_positions)):
        reason = index_reason(name, t, k.shape[0])
        if reason:
            return reason
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim == 0 or rot_dim % 2:
        return f"rotary dim {rot_dim} is not a positive even number"
    if k.dim() == 3 and rot_dim > k.shape[2]:
        return f"rotary dim {rot_dim} exceeds head dim {k.shape[2]}"
    if k.dim() == 2 and k.shape[1] % rot_dim:
        return f"k width {k.shape[1]} is not a multiple of the rotary dim {rot_dim}"
    return device_reason(k, old_positions, new_positions, cos_sin_cache)


register("cuda", "rope_rerotate_k", rope_rerotate_k, verify_rope_rerotate_k)
