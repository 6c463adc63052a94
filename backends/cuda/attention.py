"""Attention of selected queries over all keys with the exact per-position causal mask.

Flash-attention-style: each program owns a tile of query rows of one KV head and walks the key
tiles with an online softmax in fp32. A query at position ``p`` sees keys ``0..p``; the mask is a
compare of key index and query position inside the tile (no ``Nq x Nk`` mask exists), and the
walk stops at the largest position of the tile, so key tiles past every query are never loaded.

Grouped-query attention: the query heads that share one KV head are packed into the rows of the
same tile (row ``r`` is query ``r // G``, head ``kv_head * G + r % G``), so each K/V tile is loaded
once for the whole group, and a group of 3 wastes nothing on padding.

How a launch is tiled is an :class:`~.attention_tiling.AttentionTiling`: the tile sizes, and
three choices measured on Hopper (``docs/measurements/h100-kernels.md``): the key tiles every row
of the tile sees walked without the mask (``split``), the tiles with the most keys started first
(``heavy_first``), and K/V tiles loaded by the tensor memory accelerator (``tma``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from lmcache_backend.ops import register
from lmcache_backend.ops.reference import window_reason

from ._common import device_of, device_reason, float_dtype_reason, index_reason, interpret_mode
from .attention_tiling import AttentionTiling, default_tiling, fit_grid, tma_descriptors

_LOG2E = 1.4426950408889634


@triton.jit
def _query_rows(
    q_ptr,
    pos_ptr,
    num_q,
    group,
    stride_qn,
    stride_qh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):
    """This program's tile of query rows: the rows of the query heads sharing one KV head,
    packed (row ``r`` is query ``r // group``, head ``kv_head * group + r % group``). The grid
    is query tiles x KV heads, or with ``HEAVY_FIRST`` KV heads x query tiles walked from the
    last: the GPU starts programs in grid order, and with sorted positions the last tiles read
    the most keys, so every head's longest tiles start first and the short ones fill the tail.
    Returns ``(kv_head, row_mask, q_idx, q_head, pos, q)``."""
    if HEAVY_FIRST:
        kv_head = tl.program_id(0)
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        kv_head = tl.program_id(1)
        tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_q * group
    q_idx = (rows // group).to(tl.int64)
    q_head = (kv_head * group + rows % group).to(tl.int64)
    dk = tl.arange(0, HEAD_DIM)
    # Padding rows take position 0: they see key 0 only, so no row is ever fully masked.
    pos = tl.load(pos_ptr + q_idx, mask=row_mask, other=0).to(tl.int32)
    q = tl.load(
        q_ptr + q_idx[:, None] * stride_qn + q_head[:, None] * stride_qh + dk[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    return kv_head, row_mask, q_idx, q_head, pos, q


@triton.jit
def _attend_key_tile(
    q,
    k,
    v,
    keys,
    pos,
    m_i,
    l_i,
    acc,
    qk_scale_log2,
    window,
    DOT_FP32: tl.constexpr,
    WINDOWED: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """One key tile of the online softmax: ``k [D, BLOCK_N]`` and ``v [BLOCK_N, Dv]`` of the
    key indices ``keys [BLOCK_N]``, for the query rows at ``pos [BLOCK_M]`` (a row sees the keys
    at or before its position; ``WINDOWED``: only the last ``window`` of them; not ``MASKED``:
    the caller knows every row sees every key of the tile). Returns the running max, sum and
    accumulator, updated."""
    if DOT_FP32:
        qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        qk = tl.dot(q, k.to(q.dtype))
    if MASKED:
        visible = keys[None, :] <= pos[:, None]
        if WINDOWED:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        s = tl.where(visible, qk * qk_scale_log2, float("-inf"))
    else:
        s = qk * qk_scale_log2
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    shift = m_new
    if WINDOWED:
        # a row whose window starts in a later tile has seen no key yet: its max stays -inf
        # and its sums 0 (exp2(-inf - -inf) would be NaN); causally every row sees key 0 first
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - shift)
    p = tl.math.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        # Probabilities in [0, 1] lose nothing that matters in the 16-bit storage dtype,
        # and the 16-bit dot runs on tensor cores with fp32 accumulation.
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _store_rows(
    out_ptr, acc, l_i, q_idx, q_head, row_mask, stride_on, stride_oh, HEAD_DIM_V: tl.constexpr
):
    """The tile's normalised output rows, in the output's dtype."""
    dv = tl.arange(0, HEAD_DIM_V)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_idx[:, None] * stride_on + q_head[:, None] * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


@triton.jit
def _seen_by_every_row(pos, row_mask, key_end, BLOCK_N: tl.constexpr):
    """The end of the key tiles that every row of the tile sees (whole tiles at or before the
    smallest position): they need no mask. Padding rows take the tile's last position."""
    smallest = tl.min(tl.where(row_mask, pos, key_end - 1), axis=0)
    return (smallest + 1) // BLOCK_N * BLOCK_N


@triton.jit
def _contiguous_kv_tile(
    k_base,
    v_base,
    k_desc,
    v_desc,
    start,
    kv_head,
    key_end,
    stride_kn,
    stride_vn,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Key indices ``[BLOCK_N]``, ``k [D, BLOCK_N]`` and ``v [BLOCK_N, Dv]`` of the tile at
    ``start``. ``TMA``: one tensor-memory-accelerator copy each (rows past the tensor read as
    zero); else pointer loads, masked at ``key_end`` when ``MASK_KEYS``."""
    keys = start + tl.arange(0, BLOCK_N)
    if TMA:
        k = tl.trans(k_desc.load([start, kv_head * HEAD_DIM]))
        v = v_desc.load([start, kv_head * HEAD_DIM_V])
    else:
        dk = tl.arange(0, HEAD_DIM)
        dv = tl.arange(0, HEAD_DIM_V)
        keys64 = keys.to(tl.int64)
        k_ptrs = k_base + keys64[None, :] * stride_kn + dk[:, None]
        v_ptrs = v_base + keys64[:, None] * stride_vn + dv[None, :]
        if MASK_KEYS:
            key_mask = keys < key_end
            k = tl.load(k_ptrs, mask=key_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    return keys, k, v


@triton.jit
def _attention_at_positions_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    pos_ptr,
    out_ptr,
    num_q,
    num_k,
    group,
    qk_scale_log2,
    window,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WINDOWED: tl.constexpr,
    SPLIT: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    TMA: tl.constexpr,
):
    kv_head, row_mask, q_idx, q_head, pos, q = _query_rows(
        q_ptr, pos_ptr, num_q, group, stride_qn, stride_qh, HEAD_DIM, BLOCK_M, DOT_FP32, HEAVY_FIRST
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)

    # Keys beyond the largest position of this tile are masked for every row: never load them.
    key_end = tl.minimum(tl.max(pos, axis=0) + 1, num_k)
    key_start = 0
    if WINDOWED:
        # padding rows take the tile's last position (they would see no key of a late window)
        pos = tl.where(row_mask, pos, key_end - 1)
        # keys before the first row's window are masked for every row: never load them either
        key_start = tl.maximum(tl.min(pos, axis=0) - window + 1, 0) // BLOCK_N * BLOCK_N
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    if SPLIT and not WINDOWED:
        # the tiles every row sees, without a mask; then the diagonal ones, masked
        key_start = _seen_by_every_row(pos, row_mask, key_end, BLOCK_N)
        for start in range(0, key_start, BLOCK_N):
            keys, k, v = _contiguous_kv_tile(
                k_base, v_base, k_desc, v_desc, start, kv_head, key_end, stride_kn, stride_vn,
                HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, TMA,
            )  # fmt: skip
            m_i, l_i, acc = _attend_key_tile(
                q, k, v, keys, pos, m_i, l_i, acc, qk_scale_log2, window, DOT_FP32, False, False
            )
    for start in range(key_start, key_end, BLOCK_N):
        keys, k, v = _contiguous_kv_tile(
            k_base, v_base, k_desc, v_desc, start, kv_head, key_end, stride_kn, stride_vn,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, TMA,
        )  # fmt: skip
        m_i, l_i, acc = _attend_key_tile(
            q, k, v, keys, pos, m_i, l_i, acc, qk_scale_log2, window, DOT_FP32, WINDOWED
        )

    _store_rows(out_ptr, acc, l_i, q_idx, q_head, row_mask, stride_on, stride_oh, HEAD_DIM_V)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_at_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int | None = None,
    tiling: AttentionTiling | None = None,
) -> torch.Tensor:
    """Attention of selected queries over all keys with the exact per-position causal mask.

    Args:
        q: ``[Nq, Hq, D]`` fp32/fp16/bf16; any strides (the last dim is made contiguous).
        k: ``[Nk, Hkv, D]``, ``v``: ``[Nk, Hkv, Dv]``, same dtype as ``q``; row ``j`` is
            position ``j``. ``Hq`` a multiple of ``Hkv``; ``D`` and ``Dv`` powers of two in
            ``[16, 256]``.
        q_positions: ``[Nq]`` int32/int64 positions in ``[0, Nk)``.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[Nq, Hq, Dv]`` tensor of ``q.dtype`` to write into (any strides with a
            contiguous last dim).
        window: a sliding window (keyword only): the query at ``p`` attends keys
            ``p - window + 1 .. p``; a program reads only the key tiles its rows' windows touch.
        tiling: how to tile the launch (keyword only; benchmarks): default
            :func:`default_tiling` for the key count.

    Returns:
        ``[Nq, Hq, Dv]`` in ``q.dtype`` (``out`` when given): a query at position ``p`` attends
        keys ``0..p`` (fp32 softmax and accumulation; fp32 inputs use exact fp32 dots, not TF32).
    """
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads, head_dim_v = v.shape
    shape = (num_q, num_heads, head_dim_v)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    elif out.shape != shape or out.dtype != q.dtype or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"attention_at_positions: out must be a {q.dtype} tensor of {shape}")
    if num_q == 0 or num_heads == 0:
        return out
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    positions = q_positions.to(device=q.device).contiguous()
    group = num_heads // num_kv_heads
    fp32 = q.dtype == torch.float32
    # Triton's interpreter multiplies the raw bits of bf16 dot operands (triton-lang/triton
    # issue 11584), so there bf16 tiles are widened to fp32 before each dot.
    dot_fp32 = fp32 or (interpret_mode() and q.dtype == torch.bfloat16)
    tiling = tiling or default_tiling(head_dim, head_dim_v, fp32, num_k)
    k_desc, v_desc = tma_descriptors(k, v, tiling)
    tiling, grid = fit_grid(replace(tiling, tma=k_desc is not None), num_q * group, num_kv_heads)
    with device_of(q):
        _attention_at_positions_kernel[grid](
            q,
            k,
            v,
            k_desc,
            v_desc,
            positions,
            out,
            num_q,
            num_k,
            group,
            float(scale) * _LOG2E,
            window or 0,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_V=head_dim_v,
            BLOCK_M=tiling.block_m,
            BLOCK_N=tiling.block_n,
            DOT_FP32=dot_fp32,
            WINDOWED=window is not None,
            SPLIT=tiling.split,
            HEAVY_FIRST=tiling.heavy_first,
            TMA=tiling.tma,
            num_warps=tiling.num_warps,
            num_stages=tiling.num_stages,
        )
    return out


def _pow2_head_dim(d: int) -> bool:
    return 16 <= d <= 256 and d & (d - 1) == 0


def verify_attention_at_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it."""
    reason = window_reason(window)
    if reason:
        return reason
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "q, k, v must be 3-D [N, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = float_dtype_reason(name, t)
        if reason:
            return reason
    if not q.dtype == k.dtype == v.dtype:
        return f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if k.shape[:2] != v.shape[:2]:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on [Nk, Hkv]"
    if q.shape[2] != k.shape[2]:
        return f"q head dim {q.shape[2]} differs from k head dim {k.shape[2]}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads"
    if not (_pow2_head_dim(q.shape[2]) and _pow2_head_dim(v.shape[2])):
        return f"head dims {q.shape[2]}/{v.shape[2]} are not powers of two in [16, 256]"
    if k.shape[0] == 0:
        return "no keys"
    reason = index_reason("q_positions", q_positions, q.shape[0])
    if reason:
        return reason
    return device_reason(q, k, v)


register("cuda", "attention_at_positions", attention_at_positions, verify_attention_at_positions)
