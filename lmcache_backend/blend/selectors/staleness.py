"""Staleness the blend can see: how far each reused token's K/V may be from full prefill's, the
staleness-aware preview selection (``query_preview_stale``) and the blend's divergence estimate
(``blend_max_divergence``).

The preview measures what the question reads of each reused token. A read token whose K/V are
exactly full prefill's passes nothing stale on; one computed in another context does. A token's
staleness ``s_j`` is known from what the store recorded:

* its segment's provenance (:mod:`lmcache_backend.blend.segments.provenance`): 0 for a segment
  computed after exactly what precedes it now, else the distance between its context then and now (a
  chunk encoded alone, now the ``k``-th after the system part: ``1 - 1/k``); 1 where unknown;
* times the token's staleness prior, where its entry holds one (``lmcache-backend ingest
  --staleness-probes``: how far its K/V moved when computed after other passages), summed over
  layers and relative to the mean of the prompt's tokens that have one (1 without a prior).

``query_preview_stale`` ranks tokens by ``query_preview_last``'s read score times ``s_j``: the
budget goes to tokens that are both read and stale, so it moves between segments (none to exact
ones, more to those further from their context) and between requests.

The divergence estimate of a blend is the share of the last prompt token's attention (the token
whose hidden state gives the first output token; every head and scored layer of the preview
alike) that lands on stale K/V left as they were cached, each token weighted by its staleness:
``sum over j not recomputed of a_j s_j``, ``a_j`` the last token's attention probability on
token ``j`` over its total (:func:`attention_shares`). 0: everything it reads is fresh or exact.
The raw attention, not value-weighted: on MuSiQue (SmolLM2, chunks encoded alone, 20 examples)
it ranked the examples by their blend's answer KL better than the value-weighted reads did.
``blend_max_divergence`` recomputes further tokens, in the selection's order, until the estimate
is under it, at most ``blend_max_recompute_ratio`` of the reusable tokens.

Shapes: ``T`` tokens of the prompt, ``L`` layers.
"""

from __future__ import annotations

import torch

from lmcache_backend.blend.request import BlendMetadata


def token_staleness(meta: BlendMetadata, device: torch.device) -> torch.Tensor:
    """``[T]`` fp32 ``s_j`` of every token (see the module docstring); 0 for tokens not reused
    or exact (the exact prefix included)."""
    num_tokens = meta.positions.numel()
    stale = torch.zeros(num_tokens, dtype=torch.float32)
    task = meta.task
    if task is None:
        return stale.to(device)
    contexts = task.contexts if len(task.contexts) == len(task.hits) else [None] * len(task.hits)
    priors: list[tuple[int, torch.Tensor]] = []
    for (start, kv), ctx in zip(task.hits, contexts):
        distance = 1.0 if ctx is None or ctx.distance is None else ctx.distance
        if ctx is not None and ctx.exact:
            distance = 0.0
        stale[start : start + kv.num_tokens] = distance
        if kv.staleness is not None and distance > 0:
            priors.append((start, kv.staleness.float().cpu()))
    if priors:
        stale *= relative_prior(priors, num_tokens)
    stale[: meta.exact_prefix] = 0.0
    stale[~meta.valid_mask.cpu()] = 0.0
    return stale.to(device)


def relative_prior(priors: list[tuple[int, torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """``[T]`` fp32: each token's prior (``(start, [L, n])`` per segment that has one) summed
    over layers, each layer divided by its mean over the tokens that have a prior, then divided
    by ``L``; 1 for the tokens without one. Layers differ in scale by orders of magnitude:
    relative to its own mean each counts alike."""
    layers = priors[0][1].shape[0]
    known = torch.zeros(num_tokens, dtype=torch.bool)
    per_layer = torch.zeros(layers, num_tokens, dtype=torch.float32)
    for start, prior in priors:
        n = prior.shape[1]
        per_layer[:, start : start + n] = prior.clamp_min(0.0)
        known[start : start + n] = True
    mean = per_layer[:, known].mean(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.ones(num_tokens, dtype=torch.float32)
    out[known] = (per_layer[:, known] / mean).sum(dim=0) / layers
    return out


def attention_shares(last_reads: torch.Tensor) -> torch.Tensor:
    """``[T]`` fp64: the last token's attention on each token (``last_reads [T]``, summed over
    heads and scored layers) as a share of its total."""
    own = last_reads.double().clamp_min(0.0)
    total = own.sum()
    return own / total if float(total) > 0 else own


def divergence(shares: torch.Tensor, stale: torch.Tensor, chosen: torch.Tensor) -> float:
    """The estimate of a selection: ``sum(shares * stale)`` over the tokens not ``chosen``
    (``[T]`` each; ``shares`` from :func:`attention_shares`)."""
    left = torch.where(chosen.to(shares.device), torch.zeros_like(shares), shares)
    return float((left * stale.to(shares.dtype)).sum())


def count_for_divergence(
    shares: torch.Tensor,
    stale: torch.Tensor,
    ranking: torch.Tensor,
    candidates: torch.Tensor,
    limit: float,
    least: int,
    most: int,
) -> int:
    """The fewest candidates, taken in the selection's order (``ranking [T]``, highest first),
    that bring :func:`divergence` to ``limit`` or under, kept within ``least..most`` (``least``
    wins when ``most < least``)."""
    if most <= least:
        return least
    weight = torch.where(candidates, shares * stale.to(shares.dtype), torch.zeros_like(shares))
    keys = torch.where(candidates, ranking.double(), torch.full_like(weight, float("-inf")))
    order = torch.sort(keys, descending=True, stable=True).indices
    total = float((shares * stale.to(shares.dtype)).sum())
    # the estimate after taking the first c candidates: total minus what they held
    left = total - torch.cumsum(weight[order], dim=0)
    below = torch.nonzero(left <= limit, as_tuple=False).flatten()
    needed = int(below[0]) + 1 if below.numel() else int(candidates.sum())
    return max(least, min(needed, most, int(candidates.sum())))
