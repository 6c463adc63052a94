"""Attention of selected queries over one request's rows of a paged KV cache, read through its
block table: the exact per-position causal mask of ``attention_at_positions`` without a
contiguous copy of the prompt's K/V.

The same tiling as :mod:`.attention` (a tile of query rows of one KV head, the heads of a group
packed into the rows, an online softmax in fp32, the walk stopping at the tile's largest
position); only the key addresses differ: key ``t`` is row ``t % block_size`` of block
``block_table[t // block_size]``, read with the cache's own strides, so any view of an engine's
cache serves (NHD or HND, K and V split from one tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmcache_backend.ops import register

from ._common import device_of, index_reason, interpret_mode
from .attention import (
    _LOG2E,
    _attend_key_tile,
    _query_rows,
    _seen_by_every_row,
    _store_rows,
    verify_attention_at_positions,
)
from .attention_tiling import AttentionTiling, default_paged_tiling, fit_grid


@triton.jit
def _paged_kv_tile(
    k_base,
    v_base,
    table_ptr,
    block,
    start,
    key_end,
    stride_kb,
    stride_ko,
    stride_vb,
    stride_vo,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Key indices ``[BLOCK_N]``, ``k [D, BLOCK_N]``, ``v [BLOCK_N, Dv]`` of the tile at
    ``start`` and the block numbers of the tile after it (``PREFETCH``; else ``block``
    unchanged). Key ``t`` is row ``t % BLOCK_SIZE`` of block ``block_table[t // BLOCK_SIZE]``;
    a constant block size turns both into shifts (on an H200 the kernel took 17-23% less time
    than with the block size as an argument). ``PREFETCH``: ``block`` already holds this tile's
    block numbers, read one tile ahead, so the K/V loads need not wait for the table."""
    keys = start + tl.arange(0, BLOCK_N)
    key_mask = keys < key_end
    if PREFETCH:
        this_block = block
        after = keys + BLOCK_N
        block = tl.load(table_ptr + after // BLOCK_SIZE, mask=after < key_end, other=0)
    else:
        this_block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0)
    this_block = this_block.to(tl.int64)
    offset = (keys % BLOCK_SIZE).to(tl.int64)
    k_rows = this_block * stride_kb + offset * stride_ko
    v_rows = this_block * stride_vb + offset * stride_vo
    dk = tl.arange(0, HEAD_DIM)
    dv = tl.arange(0, HEAD_DIM_V)
    if MASK_KEYS:
        k = tl.load(k_base + k_rows[None, :] + dk[:, None], mask=key_mask[None, :], other=0.0)
        v = tl.load(v_base + v_rows[:, None] + dv[None, :], mask=key_mask[:, None], other=0.0)
    else:
        k = tl.load(k_base + k_rows[None, :] + dk[:, None])
        v = tl.load(v_base + v_rows[:, None] + dv[None, :])
    return keys, k, v, block


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    table_ptr,
    pos_ptr,
    out_ptr,
    num_q,
    group,
    qk_scale_log2,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    kv_head, row_mask, q_idx, q_head, pos, q = _query_rows(
        q_ptr, pos_ptr, num_q, group, stride_qn, stride_qh, HEAD_DIM, BLOCK_M, DOT_FP32, HEAVY_FIRST
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)

    key_end = tl.max(pos, axis=0) + 1
    k_base = kc_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = vc_ptr + kv_head.to(tl.int64) * stride_vh
    first = tl.arange(0, BLOCK_N)
    block = tl.load(table_ptr + first // BLOCK_SIZE, mask=first < key_end, other=0)
    key_start = 0
    if SPLIT:
        # the tiles every row sees, without a mask; then the diagonal ones, masked
        key_start = _seen_by_every_row(pos, row_mask, key_end, BLOCK_N)
        for start in range(0, key_start, BLOCK_N):
            keys, k, v, block = _paged_kv_tile(
                k_base, v_base, table_ptr, block, start, key_end, stride_kb, stride_ko,
                stride_vb, stride_vo, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_SIZE, False, PREFETCH,
            )  # fmt: skip
            m_i, l_i, acc = _attend_key_tile(
                q, k, v, keys, pos, m_i, l_i, acc, qk_scale_log2, 0, DOT_FP32, False, False
            )
    for start in range(key_start, key_end, BLOCK_N):
        keys, k, v, block = _paged_kv_tile(
            k_base, v_base, table_ptr, block, start, key_end, stride_kb, stride_ko,
            stride_vb, stride_vo, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_SIZE, True, PREFETCH,
        )  # fmt: skip
        m_i, l_i, acc = _attend_key_tile(
            q, k, v, keys, pos, m_i, l_i, acc, qk_scale_log2, 0, DOT_FP32, False
        )

    _store_rows(out_ptr, acc, l_i, q_idx, q_head, row_mask, stride_on, stride_oh, HEAD_DIM_V)


def paged_attention_at_positions(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    key_end: int | None = None,
    tiling: AttentionTiling | None = None,
) -> torch.Tensor:
    """Attention of ``q [Nq, Hq, D]`` at ``q_positions [Nq]`` over the request's rows of
    ``key_cache``/``value_cache`` (``[num_blocks, block_size, Hkv, D]``, any strides with a
    contiguous last dim) found through ``block_table [nb]``; the query at position ``p`` attends
    keys ``0..p``. Returns ``[Nq, Hq, Dv]`` in ``q.dtype`` (fp32 softmax and accumulation).
    ``key_end`` (keyword): a host bound on the positions + 1, for the verifier (each row reads
    its own keys whatever it is). ``tiling`` (keyword only; benchmarks): how to tile the
    launch, default :func:`~.attention_tiling.default_paged_tiling` (``tma`` does not apply
    here)."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = value_cache.shape[2], value_cache.shape[3]
    out = torch.empty(num_q, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    if num_q == 0 or num_heads == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    positions = q_positions.to(device=q.device).contiguous()
    table = block_table.to(device=q.device).contiguous()
    group = num_heads // num_kv_heads
    fp32 = q.dtype == torch.float32
    # Triton's interpreter multiplies the raw bits of bf16 dot operands (triton-lang/triton
    # issue 11584), so there bf16 tiles are widened to fp32 before each dot.
    dot_fp32 = fp32 or (interpret_mode() and q.dtype == torch.bfloat16)
    tiling, grid = fit_grid(
        tiling or default_paged_tiling(head_dim, head_dim_v, fp32), num_q * group, num_kv_heads
    )
    with device_of(q):
        _paged_attention_kernel[grid](
            q,
            key_cache,
            value_cache,
            table,
            positions,
            out,
            num_q,
            group,
            float(scale) * _LOG2E,
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_V=head_dim_v,
            BLOCK_M=tiling.block_m,
            BLOCK_N=tiling.block_n,
            BLOCK_SIZE=key_cache.shape[1],
            DOT_FP32=dot_fp32,
            SPLIT=tiling.split,
            HEAVY_FIRST=tiling.heavy_first,
            PREFETCH=tiling.prefetch,
            num_warps=tiling.num_warps,
            num_stages=tiling.num_stages,
        )
    return out


def verify_paged_attention_at_positions(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    key_end: int | None = None,
) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it: the
    contiguous kernel's conditions on one block's rows (dtypes, heads, head dims, positions,
    device), then the paged ones (a contiguous head dim, a block table covering the queries:
    checked against ``key_end`` where the caller gives it, else against the positions, which
    reads them back from the device)."""
    if q.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        return "q must be [N, H, D] and the caches [num_blocks, block_size, H, D]"
    if key_cache.shape[:3] != value_cache.shape[:3]:
        return f"caches {tuple(key_cache.shape)} and {tuple(value_cache.shape)} disagree"
    if key_cache.shape[0] == 0:
        return "no blocks"
    reason = verify_attention_at_positions(q, key_cache[0], value_cache[0], q_positions, scale)
    if reason:
        return reason
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        return "the caches' head dim is not contiguous"
    reason = index_reason("block_table", block_table)
    if reason:
        return reason
    covered = block_table.numel() * key_cache.shape[1]
    if key_end is not None:
        if key_end > covered:
            return "q_positions reach past the block table"
    elif q_positions.numel() and int(q_positions.max()) >= covered:
        return "q_positions reach past the block table"
    return None


register(
    "cuda",
    "paged_attention_at_positions",
    paged_attention_at_positions,
    verify_paged_attention_at_positions,
)
