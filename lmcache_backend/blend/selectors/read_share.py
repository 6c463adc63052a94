"""The fidelity knob of the preview selections: how many reused tokens to recompute so that they
carry a target share of what the question reads from the reused text, and what share the chosen
tokens carry.

The preview runs the question over the cached K/V and measures, for every reusable token, how
much the question (and the last prompt token) reads it: attention probability times value norm,
summed over the scored layers (:mod:`lmcache_backend.blend.selectors.preview_mass`). A token that is
read and not recomputed passes its stale K/V on to the answer, so the share of those reads the
recomputed tokens hold is the request's own measure of how much of what it uses is fresh.
``blend_min_read_share`` asks for at least that share: the count rises from the ratio's
(``blend_recompute_ratios``) up to ``blend_max_recompute_ratio``'s, so a prompt whose reads
spread over many tokens gets more recompute and one whose reads sit on a few gets the ratio's.
The record of every blend carries the share it reached (``read_share``); docs/quality.md shows
what it buys.
"""

from __future__ import annotations

import torch


def _reads_of(reads: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``[T]`` float64 reads of the candidates (negative reads count as none), 0 elsewhere."""
    return torch.where(candidates, reads.double().clamp_min(0.0), torch.zeros_like(reads).double())


def count_for_read_share(
    reads: torch.Tensor,
    ranking: torch.Tensor,
    candidates: torch.Tensor,
    share: float,
    least: int,
    most: int,
) -> int:
    """The fewest candidates, taken in the selection's order, whose reads add up to ``share`` of
    all candidates' reads, kept within ``least..most`` (``least`` wins when ``most < least``).

    Args:
        reads: ``[T]`` what the question reads of each token (the preview's score before any
            ranking adjustment such as the position discount).
        ranking: ``[T]`` the scores the selection ranks by (highest first).
        candidates: ``[T]`` bool, the tokens the selection may choose.
        share: the target in ``[0, 1)``; 0 returns ``least``.
        least, most: the counts of ``blend_recompute_ratios`` and ``blend_max_recompute_ratio``.
    """
    if share <= 0 or most <= least:
        return least
    own = _reads_of(reads, candidates)
    total = float(own.sum())
    if total <= 0.0:
        return least
    keys = torch.where(candidates, ranking.double(), torch.full_like(own, float("-inf")))
    order = torch.sort(keys, descending=True, stable=True).indices
    held = torch.cumsum(own[order], dim=0)
    needed = int(torch.searchsorted(held, torch.tensor(share * total, dtype=held.dtype))) + 1
    return max(least, min(needed, most, int(candidates.sum())))


def read_share(reads: torch.Tensor, chosen: torch.Tensor, candidates: torch.Tensor) -> float:
    """The share of the candidates' ``reads [T]`` held by the ``chosen [T]`` (bool) ones; 1.0
    when nothing is read."""
    own = _reads_of(reads, candidates)
    total = float(own.sum())
    return float(own[chosen].sum()) / total if total > 0.0 else 1.0
