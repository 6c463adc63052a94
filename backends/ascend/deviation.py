"""Token selection at a check layer, composed from torch ops (no fused torch_npu op fits)."""

from __future__ import annotations

import torch

from lmcache_backend.ops import register
from lmcache_backend.ops.reference import selection_count


def kv_deviation_topk(
    k_fresh: torch.Tensor,
    k_cached: torch.Tensor,
    valid_mask: torch.Tensor,
    ratio: float,
    num_reusable: int | None = None,
) -> torch.Tensor:
    """Indices of the tokens a check layer recomputes.

    Args:
        k_fresh: ``[T, Hkv*D]`` or ``[T, Hkv, D]`` keys computed now, any float dtype.
        k_cached: same shape: cached keys re-rotated to the new positions.
        valid_mask: ``[T]`` bool (any device), True where the cached row is a store hit.
        ratio: fraction in ``[0, 1]`` of ``num_reusable`` (default: the valid tokens) to keep.
        num_reusable: the base the ratio applies to.

    Returns:
        Sorted int64 ``[N]`` on ``k_fresh.device``: the top ``selection_count(...)`` valid tokens
        by squared L2 deviation (fp32), plus every invalid token.
    """
    num_tokens = k_fresh.shape[0]
    valid = valid_mask.to(device=k_fresh.device, dtype=torch.bool)
    # One host sync: how many tokens to keep depends on how many are valid.
    count = selection_count(ratio, int(valid.sum()), num_reusable)
    keep = ~valid
    if count > 0:
        diff = k_fresh.reshape(num_tokens, -1).float() - k_cached.reshape(num_tokens, -1).float()
        deviation = (diff * diff).sum(dim=-1)
        scores = deviation.masked_fill(~valid, float("-inf"))
        top = torch.topk(scores, count, largest=True, sorted=False).indices
        keep = keep.index_fill(0, top, True)
    # nonzero yields ascending int64 indices, so no sort of the selection is needed.
    return torch.nonzero(keep, as_tuple=False).flatten().to(torch.int64)


register("ascend", "kv_deviation_topk", kv_deviation_topk)
