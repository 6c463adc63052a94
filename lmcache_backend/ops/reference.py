"""Pure-torch reference implementations of the CacheBlend ops.

Every backend (Triton on CUDA, torch-npu on Ascend) is tested against these functions; the CPU
path runs them directly. Math happens in fp32 whatever the storage dtype, so the reference is the
most accurate version of each op, not the fastest.

Shapes: ``T`` tokens, ``H`` heads (``Hq`` query heads, ``Hkv`` key/value heads), ``D`` head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Queries are processed in blocks of this many rows so the [Nq, Nk] score matrix of one block
# stays small (1024 x 8k x 9 heads x 4 B = 300 MB at most) even for long prompts.
_ATTENTION_QUERY_BLOCK = 1024


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x [T, H, D]`` (fp32) in place.

    ``cos``/``sin`` are ``[T, 1, R/2]``; NeoX pairs feature ``i`` with ``i + R/2``, GPT-J pairs
    ``2i`` with ``2i + 1``.
    """
    half = cos.shape[-1]
    if is_neox:
        x1 = x[..., :half].clone()
        x2 = x[..., half : 2 * half].clone()
        x[..., :half] = x1 * cos - x2 * sin
        x[..., half : 2 * half] = x2 * cos + x1 * sin
    else:
        x1 = x[..., 0 : 2 * half : 2].clone()
        x2 = x[..., 1 : 2 * half : 2].clone()
        x[..., 0 : 2 * half : 2] = x1 * cos - x2 * sin
        x[..., 1 : 2 * half : 2] = x2 * cos + x1 * sin
    return x


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """Return ``x [T, H, D]`` rotated to ``positions [T]`` (the forward RoPE, fp32 math).

    ``cos_sin_cache`` is vLLM's ``[max_pos, R]`` table: ``R/2`` cosines then ``R/2`` sines;
    features beyond ``R`` (partial rotary) pass through unchanged.
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    out = _rotate(x.float().clone(), cos, sin, is_neox)
    return out.to(x.dtype)


def rope_rerotate_k(
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """In place: move RoPE-encoded keys from ``old_positions`` to ``new_positions``.

    Args:
        k: ``[T, Hkv*D]`` or ``[T, Hkv, D]`` keys that were rotated at ``old_positions``;
            any float dtype (math in fp32). The last dim must hold whole heads of size ``D``;
            for the 2-D form ``D`` is taken from ``cos_sin_cache`` only when ``R == D``, so pass
            the 3-D view when the rotary dim is partial.
        old_positions, new_positions: ``[T]`` integer positions.
        cos_sin_cache: ``[max_pos, R]`` (cos half, then sin half), as in vLLM's rotary modules.
        is_neox: NeoX (split halves) pairing when True, GPT-J (interleaved) when False.

    Returns:
        ``k``, rotated in place. Undoing rotation at ``p`` and applying it at ``p'`` is one
        rotation by the angle difference, computed from the table with the angle-difference
        identities so no trigonometry is evaluated here.
    """
    if k.shape[0] == 0:
        return k
    rot_dim = cos_sin_cache.shape[-1]
    k3 = k.view(k.shape[0], -1, rot_dim) if k.dim() == 2 else k
    half = rot_dim // 2
    old = cos_sin_cache.index_select(0, old_positions.long()).float()
    new = cos_sin_cache.index_select(0, new_positions.long()).float()
    cos_o, sin_o = old[:, None, :half], old[:, None, half:]
    cos_n, sin_n = new[:, None, :half], new[:, None, half:]
    cos_d = cos_n * cos_o + sin_n * sin_o  # cos(new - old)
    sin_d = sin_n * cos_o - cos_n * sin_o  # sin(new - old)
    rotated = _rotate(k3.float().clone(), cos_d, sin_d, is_neox)
    k3.copy_(rotated.to(k3.dtype))
    return k


def token_deviation(k_fresh: torch.Tensor, k_cached: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance per token, fp32: ``[T, ...] x [T, ...] -> [T]``."""
    # explicit width: reshape(0, -1) is ambiguous and raises for an empty selection
    width = math.prod(k_fresh.shape[1:])
    diff = (
        k_fresh.reshape(k_fresh.shape[0], width).float()
        - k_cached.reshape(k_cached.shape[0], width).float()
    )
    return (diff * diff).sum(dim=-1)


def selection_count(ratio: float, num_valid: int, num_reusable: int | None = None) -> int:
    """How many valid tokens a check layer keeps: ``int(ratio * base)``, at least one when
    ``ratio > 0`` and a valid token exists, at most ``num_valid``.

    ``base`` is ``num_reusable`` (all reusable tokens of the prompt) when given, else
    ``num_valid``: a later check layer keeps a fraction of the whole prompt's reusable tokens.
    """
    base = num_valid if num_reusable is None else num_reusable
    count = int(ratio * base)
    if ratio > 0 and num_valid > 0:
        count = max(count, 1)
    return min(count, num_valid)


def select_topk_with_invalid(
    deviation: torch.Tensor, valid_mask: torch.Tensor, count: int
) -> torch.Tensor:
    """Sorted int64 indices: the ``count`` valid tokens with the largest ``deviation [T]`` plus
    every invalid token. Ties break toward the lower index (stable order)."""
    valid = valid_mask.to(device=deviation.device, dtype=torch.bool)
    invalid_idx = torch.nonzero(~valid, as_tuple=False).flatten()
    if count <= 0:
        return invalid_idx.to(torch.int64)
    scores = deviation.masked_fill(~valid, float("-inf"))
    top = torch.topk(scores, count, largest=True, sorted=False).indices
    return torch.sort(torch.cat([top, invalid_idx])).values.to(torch.int64)


def kv_deviation_topk(
    k_fresh: torch.Tensor,
    k_cached: torch.Tensor,
    valid_mask: torch.Tensor,
    ratio: float,
    num_reusable: int | None = None,
) -> torch.Tensor:
    """Indices of the tokens a check layer recomputes.

    Args:
        k_fresh: ``[T, Hkv*D]`` or ``[T, Hkv, D]`` keys computed now (at the new positions).
        k_cached: same shape: cached keys re-rotated to the new positions.
        valid_mask: ``[T]`` bool, True where the cached row is real (a store hit).
        ratio: fraction in ``[0, 1]``.
        num_reusable: the base the ratio applies to (defaults to the number of valid tokens).

    Returns:
        Sorted int64 ``[N]`` on ``k_fresh.device``: the top ``selection_count(...)`` valid tokens
        by squared L2 deviation, plus every invalid token.
    """
    valid = valid_mask.to(device=k_fresh.device, dtype=torch.bool)
    count = selection_count(ratio, int(valid.sum()), num_reusable)
    return select_topk_with_invalid(token_deviation(k_fresh, k_cached), valid, count)


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x [T, ...]``, ``indices [N]`` -> ``[N, ...]`` (a new tensor)."""
    return x.index_select(0, indices.to(device=x.device, dtype=torch.int64))


def scatter_rows(dst: torch.Tensor, indices: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """In place ``dst[indices] = src``; ``dst [T, ...]``, ``src [N, ...]``. Returns ``dst``."""
    dst.index_copy_(0, indices.to(device=dst.device, dtype=torch.int64), src.to(dst.dtype))
    return dst


def attention_at_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of selected queries over all keys with the exact per-position causal mask.

    Args:
        q: ``[Nq, Hq, D]`` queries of the tokens being computed.
        k, v: ``[Nk, Hkv, D]`` keys/values of the whole prompt; row ``j`` is position ``j``.
            ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention).
        q_positions: ``[Nq]`` positions of the queries in ``[0, Nk)``.
        scale: softmax scale (usually ``D ** -0.5``).
        window: a sliding window (keyword only): the query at ``p`` attends keys
            ``p - window + 1 .. p`` (HF's and vLLM's convention); None: no window.

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``; a query at position ``p`` attends keys ``0..p`` only
        (fp32 math). This is not flash-attention's ``causal=True``, which aligns the triangle to
        the bottom-right corner when ``Nq < Nk``.
    """
    num_q, num_heads, head_dim = q.shape
    out = torch.empty(num_q, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    if num_q == 0:
        return out
    gqa = num_heads != k.shape[1]
    positions = q_positions.to(device=q.device, dtype=torch.int64)
    for start, stop in _query_blocks(positions, window):
        block = positions[start:stop]
        # only the keys some query of the block can see: up to its last position, and from
        # its first position's window on (a sliding-window layer then costs ~window keys a
        # query instead of the whole prompt)
        lo = 0 if window is None else max(0, int(block.min()) - window + 1)
        hi = int(block.max()) + 1
        key_pos = torch.arange(lo, hi, device=q.device)
        mask = key_pos[None, :] <= block[:, None]
        if window is not None:
            mask &= key_pos[None, :] > block[:, None] - window
        # SDPA wants 4-D [B, H, L, D]; 3-D inputs fall to a slower path on CPU.
        kf = k[lo:hi].float().transpose(0, 1).unsqueeze(0)
        vf = v[lo:hi].float().transpose(0, 1).unsqueeze(0)
        qf = q[start:stop].float().transpose(0, 1).unsqueeze(0)
        res = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        out[start:stop] = res[0].transpose(0, 1).to(q.dtype)
    return out


def window_reason(window: object) -> str | None:
    """Why ``window`` is not a sliding window a kernel can apply (a whole number of positions,
    at least one), or None; None itself (no window) is fine."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        return f"the window must be a whole number of positions, got {window!r}"
    if window < 1:
        return f"the window must be at least one position, got {window}"
    return None


def _query_blocks(positions: torch.Tensor, window: int | None) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of the queries at ``positions [Nq]``, at most
    :data:`_ATTENTION_QUERY_BLOCK` each; with a ``window``, a block also ends before a query
    ``window`` or more positions after the block's first (sorted positions then keep a block's
    keys within two windows; unsorted ones stay exact, only slower)."""
    num_q = positions.shape[0]
    if window is None:
        return [
            (start, min(start + _ATTENTION_QUERY_BLOCK, num_q))
            for start in range(0, num_q, _ATTENTION_QUERY_BLOCK)
        ]
    pos = positions.tolist()
    blocks, start = [], 0
    for i in range(1, num_q):
        if i - start >= _ATTENTION_QUERY_BLOCK or pos[i] - pos[start] >= window:
            blocks.append((start, i))
            start = i
    blocks.append((start, num_q))
    return blocks


def paged_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write contiguous K/V rows into a paged cache (vLLM flash-attention layout).

    Args:
        key, value: ``[T, Hkv, D]``.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` (one layer's
            ``kv_cache[0]`` and ``kv_cache[1]`` in vLLM's ``[2, num_blocks, block_size, Hkv, D]``).
        slot_mapping: ``[T]`` int, slot ``s`` is row ``s % block_size`` of block
            ``s // block_size``; a negative slot (vLLM's padding) is skipped.
    """
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    # block/row indexing works on any strides (e.g. the ``kv_cache[:, 0]`` view of a cache
    # laid out as [num_blocks, 2, block_size, H, D]), where ``view(-1, ...)`` would raise
    block_size = key_cache.shape[1]
    blocks, rows = slots // block_size, slots % block_size
    key_cache[blocks, rows] = key[keep].to(key_cache.dtype)
    value_cache[blocks, rows] = value[keep].to(value_cache.dtype)


def paged_kv_read(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K/V rows ``[T, Hkv, D]`` from a paged cache laid out as in :func:`paged_kv_write`.

    Every slot must be non-negative.
    """
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    if bool((slots < 0).any()):
        raise ValueError("paged_kv_read: slot_mapping holds negative (padding) slots")
    block_size = key_cache.shape[1]
    blocks, rows = slots // block_size, slots % block_size
    return key_cache[blocks, rows], value_cache[blocks, rows]


def paged_attention_at_positions(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    key_end: int | None = None,
) -> torch.Tensor:
    """:func:`attention_at_positions` over one request's rows of a paged cache.

    Args:
        q: ``[Nq, Hq, D]`` queries at sorted ``q_positions [Nq]``.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, any strides (views of an
            engine's cache, as :func:`paged_kv_write` takes them).
        block_table: ``[nb]`` int: the request's blocks in order; its token ``t`` lives in block
            ``block_table[t // block_size]`` at row ``t % block_size``.
        q_positions: ``[Nq]`` positions of the queries; keys ``0..max(q_positions)`` must be
            covered by ``block_table``.
        scale: softmax scale.
        key_end: (keyword) a bound the caller knows on the host: every position is below it,
            keys ``0..key_end-1`` are covered by ``block_table`` and hold written rows. None:
            ``max(q_positions) + 1``, read from the tensor (on a device, a wait for it).

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``: the query at position ``p`` attends the request's keys
        ``0..p`` (fp32 math). This reference gathers those rows first; the kernels read them
        through the block table.
    """
    return attention_over_gathered_rows(
        q, key_cache, value_cache, block_table, q_positions, scale, paged_kv_read,
        attention_at_positions, key_end,
    )  # fmt: skip


def attention_over_gathered_rows(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    read: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    attend: Callable[..., torch.Tensor],
    key_end: int | None = None,
) -> torch.Tensor:
    """``paged_attention_at_positions`` composed of two ops: ``read`` (a ``paged_kv_read``)
    gathers the request's rows ``0..key_end-1`` (default ``0..max(q_positions)``) through the
    block table (one layer's, freed after the call), ``attend`` (an ``attention_at_positions``)
    attends over them."""
    if q.shape[0] == 0:
        return torch.empty(0, *q.shape[1:], dtype=q.dtype, device=q.device)
    block_size = key_cache.shape[1]
    end = int(q_positions.max()) + 1 if key_end is None else key_end
    positions = torch.arange(end, device=key_cache.device)
    table = block_table.to(device=key_cache.device, dtype=torch.int64)
    slots = table[positions // block_size] * block_size + positions % block_size
    keys, values = read(key_cache, value_cache, slots)
    return attend(q, keys, values, q_positions, scale)
