"""Per-token K deviation fused with the masking that feeds top-k selection.

One pass reads both key tensors once and writes one fp32 score per token: the squared L2
distance for valid (cached) tokens and ``-inf`` for invalid ones, ready for ``torch.topk``. The
selection itself reuses the reference helpers, so the count semantics (``int(ratio * base)``, at
least one, ``num_reusable`` as the base) and tie order are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmcache_backend.ops import register
from lmcache_backend.ops.reference import select_topk_with_invalid, selection_count

from ._common import device_of, device_reason, float_dtype_reason, next_pow2, rows_2d

_BLOCK_TOKENS = 16
# Feature chunk per loop step: 16 tokens x 256 features x 2 inputs keeps 32 fp32 registers per
# thread at 4 warps.
_MAX_BLOCK_FEATURES = 256


@triton.jit
def _kv_deviation_kernel(
    fresh_ptr,
    cached_ptr,
    valid_ptr,
    out_ptr,
    num_tokens,
    num_features,
    stride_fresh,
    stride_cached,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = toks < num_tokens
    toks64 = toks.to(tl.int64)
    fresh_rows = fresh_ptr + toks64[:, None] * stride_fresh
    cached_rows = cached_ptr + toks64[:, None] * stride_cached
    acc = tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.float32)
    for start in range(0, num_features, BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)
        mask = tok_mask[:, None] & (cols < num_features)[None, :]
        a = tl.load(fresh_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(cached_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        diff = a - b
        acc += diff * diff
    deviation = tl.sum(acc, axis=1)
    valid = tl.load(valid_ptr + toks, mask=tok_mask, other=0)
    score = tl.where(valid != 0, deviation, float("-inf"))
    tl.store(out_ptr + toks, score, mask=tok_mask)


def masked_token_deviation(
    k_fresh: torch.Tensor, k_cached: torch.Tensor, valid_mask: torch.Tensor
) -> torch.Tensor:
    """Squared L2 deviation per token, ``-inf`` where ``valid_mask`` is False.

    Args:
        k_fresh, k_cached: ``[T, ...]`` of the same shape, fp32/fp16/bf16 (math in fp32).
        valid_mask: ``[T]`` bool.

    Returns:
        ``[T]`` fp32 on ``k_fresh.device``.
    """
    num_tokens = k_fresh.shape[0]
    out = torch.empty(num_tokens, dtype=torch.float32, device=k_fresh.device)
    if num_tokens == 0:
        return out
    fresh = rows_2d(k_fresh)
    cached = rows_2d(k_cached)
    valid = valid_mask.to(device=k_fresh.device, dtype=torch.bool).contiguous().view(torch.uint8)
    num_features = fresh.shape[1]
    block_f = min(next_pow2(num_features), _MAX_BLOCK_FEATURES)
    grid = (triton.cdiv(num_tokens, _BLOCK_TOKENS),)
    with device_of(fresh):
        _kv_deviation_kernel[grid](
            fresh,
            cached,
            valid,
            out,
            num_tokens,
            num_features,
            fresh.stride(0),
            cached.stride(0),
            BLOCK_T=_BLOCK_TOKENS,
            BLOCK_F=block_f,
            num_warps=4,
        )
    return out


def kv_deviation_topk(
    k_fresh: torch.Tensor,
    k_cached: torch.Tensor,
    valid_mask: torch.Tensor,
    ratio: float,
    num_reusable: int | None = None,
) -> torch.Tensor:
    """Indices of the tokens a check layer recomputes.

    Args:
        k_fresh: ``[T, Hkv*D]`` or ``[T, Hkv, D]`` keys computed now, fp32/fp16/bf16.
        k_cached: same shape: cached keys re-rotated to the new positions.
        valid_mask: ``[T]`` bool, True where the cached row is real.
        ratio: fraction in ``[0, 1]``.
        num_reusable: the base the ratio applies to (defaults to the number of valid tokens).

    Returns:
        Sorted int64 ``[N]`` on ``k_fresh.device``: the top ``selection_count(...)`` valid tokens
        by squared L2 deviation, plus every invalid token (the reference's result).
    """
    valid = valid_mask.to(device=k_fresh.device, dtype=torch.bool)
    scores = masked_token_deviation(k_fresh, k_cached, valid)
    count = selection_count(ratio, int(valid.sum()), num_reusable)
    # The scores are already -inf where invalid, so the helper's own masking changes nothing.
    return select_topk_with_invalid(scores, valid, count)


def verify_kv_deviation_topk(
    k_fresh: torch.Tensor,
    k_cached: torch.Tensor,
    valid_mask: torch.Tensor,
    ratio: float,
    num_reusable: int | None = None,
) -> str | None:
    """Reason to leave a call to the reference, or ``None`` when the kernel serves it."""
    if k_fresh.shape != k_cached.shape:
        return f"k_fresh {tuple(k_fresh.shape)} and k_cached {tuple(k_cached.shape)} differ"
    if k_fresh.dim() < 1:
        return "keys are 0-D"
    for name, t in (("k_fresh", k_fresh), ("k_cached", k_cached)):
        reason = float_dtype_reason(name, t)
        if reason:
            return reason
    if valid_mask.shape != (k_fresh.shape[0],):
        return f"valid_mask shape {tuple(valid_mask.shape)} is not [{k_fresh.shape[0]}]"
    return device_reason(k_fresh, k_cached)


register("cuda", "kv_deviation_topk", kv_deviation_topk, verify_kv_deviation_topk)
