"""Row gather and in-place row scatter of K/V tensors.

Each program moves a tile of whole rows, so one index load serves a full row and the copy stays
coalesced along the contiguous features. Rows may have any stride (a slice of a larger buffer);
the features inside a row must be contiguous for the indexed side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmcache_backend.ops import register

from ._common import device_of, device_reason, index_reason, next_pow2, rows_2d, rows_view

# About 4096 elements per program (8-32 KB): enough bytes in flight to keep a copy memory-bound.
_ELEMENTS_PER_PROGRAM = 4096
_MAX_BLOCK_FEATURES = 1024
# 8 warps kept more loads in flight than 4: on an H200, 0.156-0.159 ms instead of 0.166-0.171 ms
# to move half of a 262,144 x 1,024 bf16 tensor's rows (the copy bandwidth's 80% line lies between)
_NUM_WARPS = 8


def _blocks(num_rows: int, num_features: int) -> tuple[int, int]:
    block_f = min(next_pow2(num_features), _MAX_BLOCK_FEATURES)
    block_n = min(max(_ELEMENTS_PER_PROGRAM // block_f, 1), next_pow2(num_rows))
    return block_n, block_f


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    idx_ptr,
    dst_ptr,
    num_idx,
    num_src_rows,
    num_features,
    stride_src,
    stride_dst,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < num_idx
    idx = tl.load(idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    # Out-of-range indices break the contract; never read outside the source for them.
    src_ok = row_mask & (idx >= 0) & (idx < num_src_rows)
    col_mask = (cols < num_features)[None, :]
    vals = tl.load(
        src_ptr + idx[:, None] * stride_src + cols[None, :],
        mask=src_ok[:, None] & col_mask,
        other=0,
    )
    dst = dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :]
    tl.store(dst, vals, mask=row_mask[:, None] & col_mask)


@triton.jit
def _scatter_rows_kernel(
    dst_ptr,
    idx_ptr,
    src_ptr,
    num_idx,
    num_dst_rows,
    num_features,
    stride_dst,
    stride_src,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < num_idx
    idx = tl.load(idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    # Out-of-range indices break the contract; never write outside the destination for them.
    dst_ok = row_mask & (idx >= 0) & (idx < num_dst_rows)
    mask = dst_ok[:, None] & (cols < num_features)[None, :]
    vals = tl.load(src_ptr + rows.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=mask)
    tl.store(dst_ptr + idx[:, None] * stride_dst + cols[None, :], vals, mask=mask)


def _index_tensor(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return indices.to(device=device).contiguous()


def gather_rows(
    x: torch.Tensor, indices: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``x[indices]``.

    Args:
        x: ``[T, ...]`` any dtype; rows may have any stride, features within a row contiguous.
        indices: ``[N]`` int32/int64, each in ``[0, T)``.
        out: optional contiguous ``[N, ...]`` tensor of ``x.dtype`` to write into (saves an
            allocation when the caller reuses a buffer).

    Returns:
        ``[N, ...]`` contiguous, ``x.dtype``, on ``x.device`` (``out`` when given).
    """
    shape = (indices.shape[0], *x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"gather_rows: out must be a contiguous {x.dtype} tensor of {shape}")
    # The verifier declines rows that are not contiguous inside; a direct call pays a copy.
    src = rows_2d(x)
    num_idx = indices.shape[0]
    if num_idx == 0 or out.numel() == 0:
        return out
    idx = _index_tensor(indices, x.device)
    dst = out.view(num_idx, out.numel() // num_idx)
    num_features = dst.shape[1]
    block_n, block_f = _blocks(num_idx, num_features)
    grid = (triton.cdiv(num_idx, block_n), triton.cdiv(num_features, block_f))
    with device_of(x):
        _gather_rows_kernel[grid](
            src,
            idx,
            dst,
            num_idx,
            src.shape[0],
            num_features,
            src.stride(0),
            dst.stride(0),
            BLOCK_N=block_n,
            BLOCK_F=block_f,
            num_warps=_NUM_WARPS,
        )
    return out


def scatter_rows(dst: torch.Tensor, indices: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """In place ``dst[indices] = src``.

    Args:
        dst: ``[T, ...]`` any dtype; rows may have any stride, features within a row contiguous.
        indices: ``[N]`` int32/int64, each in ``[0, T)``, without repeats.
        src: ``[N, ...]`` with ``dst``'s row shape, any strides; cast to ``dst.dtype``.

    Returns:
        ``dst``.
    """
    num_idx = indices.shape[0]
    if num_idx == 0 or dst.numel() == 0:
        return dst
    flat_dst = rows_view(dst)
    if flat_dst is None:
        raise ValueError("scatter_rows: dst rows must be contiguous inside (any row stride)")
    # Cast with torch (src is the small side): same rounding as the reference on every device,
    # where the Triton interpreter would truncate fp32 -> bf16.
    flat_src = rows_2d(src if src.dtype == dst.dtype else src.to(dst.dtype))
    idx = _index_tensor(indices, dst.device)
    num_features = flat_dst.shape[1]
    block_n, block_f = _blocks(num_idx, num_features)
    grid = (triton.cdiv(num_idx, block_n), triton.cdiv(num_features, block_f))
    with device_of(dst):
        _scatter_rows_kernel[grid](
            flat_dst,
            idx,
            flat_src,
            num_idx,
            flat_dst.shape[0],
            num_features,
            flat_dst.stride(0),
            flat_src.stride(0),
            BLOCK_N=block_n,
            BLOCK_F=block_f,
            num_warps=_NUM_WARPS,
        )
    return dst


def verify_gather_rows(x: torch.Tensor, indices: torch.Tensor) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it."""
    if x.dim() < 1:
        return "x is 0-D"
    reason = index_reason("indices", indices)
    if reason:
        return reason
    if x.dtype.is_complex:
        return "complex dtypes"
    if rows_view(x) is None:
        return "x rows are not contiguous within a row"
    return device_reason(x)


def verify_scatter_rows(dst: torch.Tensor, indices: torch.Tensor, src: torch.Tensor) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it."""
    if dst.dim() < 1:
        return "dst is 0-D"
    reason = index_reason("indices", indices)
    if reason:
        return reason
    if src.dim() < 1 or src.shape[0] != indices.shape[0] or src.shape[1:] != dst.shape[1:]:
        return f"src {tuple(src.shape)} does not match [{indices.shape[0]}, *{dst.shape[1:]}]"
    if rows_view(dst) is None:
        return "dst rows are not contiguous within a row"
    if src.dtype.is_complex or dst.dtype.is_complex:
        return "complex dtypes"
    return device_reason(dst, src)


register("cuda", "gather_rows", gather_rows, verify_gather_rows)
register("cuda", "scatter_rows", scatter_rows, verify_scatter_rows)
