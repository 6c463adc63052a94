"""Attention of selected queries with the exact per-position causal mask, on Ascend.

fp16/bf16 inputs go to ``torch_npu.npu_fused_infer_attention_score`` with an explicit boolean
mask. Ascend masks are the opposite of torch SDPA's: True (1) means *masked out*, so key ``j`` is
masked for a query at position ``p`` exactly when ``j > p``. Shapes the fused op does not take
(fp32, head dims not a multiple of 16, ...) run the same math composed from torch ops in fp32.
"""

from __future__ import annotations

import torch

from lmcache_backend.backends.ascend._npu import npu, on_npu_reason
from lmcache_backend.ops import register
from lmcache_backend.ops.reference import attention_over_gathered_rows

# Queries per call: the [block, Nk] mask of one block stays small (1024 x 32k = 32 MB of bool).
_QUERY_BLOCK = 1024
# npu_fused_infer_attention_score limits (Atlas A2/A3, Q_S > 1 and Q_S == 1 alike): fp16/bf16
# query, head dim a multiple of 16 and <= 512, at most 256 query heads, at most 64 query heads
# per key/value head, key and value of one shape.
_FUSED_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 512
_MAX_HEADS = 256
_MAX_GROUP = 64


def fused_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the fused op cannot take these inputs (they then run composed), or ``None``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if q.dtype not in _FUSED_DTYPES:
        return f"query dtype {q.dtype} is not fp16/bf16"
    if head_dim % 16 or head_dim > _MAX_HEAD_DIM:
        return f"head dim {head_dim} is not a multiple of 16 up to {_MAX_HEAD_DIM}"
    if num_heads > _MAX_HEADS:
        return f"{num_heads} query heads > {_MAX_HEADS}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > _MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} key heads is not a GQA ratio <= 64"
    if k.shape != v.shape or k.shape[-1] != head_dim:
        return "key and value shapes differ from each other or from the query head dim"
    return None


def _attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Fill ``out [Nq, Hq, D]`` with the fused op, BSND layout (B = 1), one call per block."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    # BSND is [1, S, N, D]: the token-major layout we already hold, so no transpose is needed.
    key = k.to(q.dtype).contiguous().unsqueeze(0)
    value = v.to(q.dtype).contiguous().unsqueeze(0)
    key_pos = torch.arange(k.shape[0], device=q.device)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, q.shape[0])
        query = q[start:stop].contiguous().unsqueeze(0)
        # [1, 1, Q_S, KV_S] bool, True = masked out (the Ascend convention).
        masked = (key_pos[None, :] > positions[start:stop, None])[None, None]
        res, _ = npu().npu_fused_infer_attention_score(
            query,
            key,
            value,
            atten_mask=masked,
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            scale=scale,
            input_layout="BSND",
            sparse_mode=0,
            # High precision; every row keeps at least its own key, so no row-invalid correction.
            inner_precise=0,
        )
        out[start:stop] = res[0]


def _attention_composed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Fill ``out [Nq, Hq, Dv]`` with fp32 matmul + masked softmax, grouped by key head."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    keys_t = k.float().permute(1, 2, 0)  # [Hkv, D, Nk]
    values = v.float().transpose(0, 1)  # [Hkv, Nk, Dv]
    key_pos = torch.arange(k.shape[0], device=q.device)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, q.shape[0])
        rows = stop - start
        # query head h = kv * group + g reads key head kv (the usual GQA grouping)
        qf = q[start:stop].float().transpose(0, 1).reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(qf, keys_t).mul_(scale).view(num_kv_heads, group, rows, -1)
        future = key_pos[None, :] > positions[start:stop, None]  # [rows, Nk]
        probs = scores.masked_fill_(future, float("-inf")).softmax(dim=-1)
        res = torch.bmm(probs.view(num_kv_heads, group * rows, -1), values)
        res = res.view(num_heads, rows, -1).transpose(0, 1)
        out[start:stop] = res.to(out.dtype)


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
        q: ``[Nq, Hq, D]`` queries (fp16/bf16 take the fused op, fp32 the composed path).
        k, v: ``[Nk, Hkv, D]`` keys/values of the whole prompt; row ``j`` is position ``j``;
            ``Hq`` a multiple of ``Hkv``.
        q_positions: ``[Nq]`` integer positions in ``[0, Nk)`` (any device).
        scale: softmax scale.

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype`` on ``q.device``: a query at position ``p`` attends keys
        ``0..p`` only.
    """
    if window is not None:  # the verifier sends these to the torch reference
        raise ValueError("attention_at_positions: the NPU path has no sliding window")
    num_q, num_heads, _ = q.shape
    out = torch.empty(num_q, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    if num_q == 0:
        return out
    positions = q_positions.to(device=q.device, dtype=torch.int64)
    if fused_unsupported_reason(q, k, v) is None:
        _attention_fused(q, k, v, positions, scale, out)
    else:
        _attention_composed(q, k, v, positions, scale, out)
    return out


def verify_attention_at_positions(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, window: int | None = None, **kwargs
) -> str | None:
    """Verifier for the op registry: the device matters (other shapes run composed), and a
    sliding window goes to the torch reference."""
    if window is not None:
        return "no sliding window on the NPU path"
    return on_npu_reason(q, k, v)


register("ascend", "attention_at_positions", attention_at_positions, verify_attention_at_positions)


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
    """``attention_at_positions`` over the request's rows of a paged cache (``[num_blocks,
    block_size, Hkv, D]`` each): the rows ``0..key_end-1`` (default ``0..max(q_positions)``) are
    gathered through the block table with this backend's ``paged_kv_read`` (one layer's rows,
    freed after the call), then attended with the fused operator."""
    from lmcache_backend.backends.ascend.paged_kv import paged_kv_read

    return attention_over_gathered_rows(
        q, key_cache, value_cache, block_table, q_positions, scale, paged_kv_read,
        attention_at_positions, key_end,
    )  # fmt: skip


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
    """Reason to leave a call to the reference (tensors not on an NPU, caches that are not
    vllm-ascend's contiguous ``[num_blocks, block_size, H, D]``), or None."""
    reason = on_npu_reason(q, key_cache, value_cache)
    if reason is None and not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        reason = "the caches are not contiguous [num_blocks, block_size, H, D] tensors"
    return reason


register(
    "ascend",
    "paged_attention_at_positions",
    paged_attention_at_positions,
    verify_paged_attention_at_positions,
)
