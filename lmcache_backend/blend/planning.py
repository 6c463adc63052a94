"""A request's plan: which of its tokens are reused, which are computed, and whether it blends
at all (it falls back to a full prefill with too little to reuse or a prompt longer than the
model's exact attention span)."""

from __future__ import annotations

import logging

import torch

from lmcache_backend.blend.request import BlendMetadata, BlendRequest, LayerPrefix
from lmcache_backend.blend.segments.provenance import exact_run
from lmcache_backend.blend.segments.retriever import SPTBlendRetriever, SPTBlendRetrieverTask
from lmcache_backend.blend.selectors.selection import PREVIEW_SELECTIONS
from lmcache_backend.config import BlendConfig
from lmcache_backend.models.base import ModelAdapter

logger = logging.getLogger(__name__)


def plan_request(
    request: BlendRequest,
    config: BlendConfig,
    retriever: SPTBlendRetriever,
    model: ModelAdapter,
    timer,
) -> BlendMetadata:
    """Look ``request``'s segments up and decide whether and what to blend, under ``config``
    (the request's settings).

    Raises:
        ValueError: the request is inconsistent (an empty prompt, a ``cached_prefix`` or
            ``mask`` of the wrong size, a ``compute_end`` outside the prompt, ``strict_end``
            with a selection that computes the tail at its check layers).
    """
    token_list = request.token_ids
    num_tokens = len(token_list)
    if num_tokens == 0:
        raise ValueError("LMCBlender: the prompt holds no tokens")
    cached_prefix, compute_end = request.cached_prefix, request.compute_end
    strict_end, recompute, mask = request.strict_end, request.recompute, request.mask
    device = model.device
    # the request's salt names the only namespace it may reuse from (no other tenant's entries)
    task = retriever.new_request(token_list, None, cache_salt=request.cache_salt)
    timer.lap("lookup")
    valid = task.valid_mask.clone()
    if cached_prefix is not None:
        prefix_len = cached_prefix[0][0].shape[0] if len(cached_prefix[0]) else 0
        if len(cached_prefix[0]) != model.num_layers or prefix_len > num_tokens:
            raise ValueError(
                f"cached_prefix must hold {model.num_layers} layers of at most "
                f"{num_tokens} tokens, got {len(cached_prefix[0])} layers of {prefix_len}"
            )
        valid[:prefix_len] = True
    if compute_end is not None and not 1 <= compute_end <= num_tokens:
        raise ValueError(f"compute_end must be in 1..{num_tokens}, got {compute_end}")
    if strict_end and compute_end is None:
        raise ValueError("strict_end needs compute_end")
    for name, flags in (("mask", mask), ("recompute", recompute)):
        if flags is not None and flags.numel() != num_tokens:
            raise ValueError(f"{name} has {flags.numel()} entries for {num_tokens} tokens")
    if mask is not None:
        valid &= mask.to("cpu", torch.bool)
    num_reusable = int(valid.sum())
    reason = None
    span = model.max_exact_tokens
    if span is not None and num_tokens > span:
        reason = f"{num_tokens} tokens exceed the model's sliding window of {span}"
    elif num_reusable < config.blend_min_tokens:
        reason = f"{num_reusable} reusable tokens < blend_min_tokens={config.blend_min_tokens}"
    if reason is not None:
        logger.info("CacheBlend falls back to a full prefill: %s", reason)
        valid.zero_()
        num_reusable = 0
        if strict_end:
            # causal attention: tokens before compute_end do not depend on the later ones,
            # so the prefill of the head alone gives their K/V (and computes nothing after)
            num_tokens = compute_end
            valid = valid[:num_tokens]
    active = torch.arange(num_tokens)
    schedule = dict(config.check_schedule()) if num_reusable else {}
    if (
        strict_end
        and schedule
        and recompute is None
        and config.blend_selection not in PREVIEW_SELECTIONS
    ):
        raise ValueError(
            f"strict_end: blend_selection={config.blend_selection!r} computes the "
            "tokens after compute_end at its check layers"
        )
    if recompute is not None and num_reusable:
        chosen = recompute.to("cpu", torch.bool) | ~valid
        chosen[-1] = True
        active = torch.nonzero(chosen, as_tuple=False).flatten()
        schedule = {}
    reusable_at = torch.nonzero(valid, as_tuple=False).flatten()
    query_start = int(reusable_at[-1]) + 1 if reusable_at.numel() else 0
    exact_prefix = _exact_prefix(task, cached_prefix)
    meta = BlendMetadata(
        positions=torch.arange(num_tokens, device=device),
        active=active.to(device),
        valid_mask=valid.to(device),
        num_reusable=num_reusable,
        schedule=schedule,
        task=task if num_reusable else None,
        config=config,
        query_start=query_start,
        exact_prefix=exact_prefix if num_reusable else 0,
        cached_prefix=cached_prefix if num_reusable else None,
        fallback_reason=reason,
        compute_end=compute_end,
        strict_end=strict_end,
        timer=timer,
    )
    if recompute is not None:  # a fixed selection: the tail is the engine's from layer 0
        meta.active = meta.active[meta.drop_tail(torch.arange(meta.active.numel()))]
    return meta


def _exact_prefix(task: SPTBlendRetrieverTask, cached_prefix: LayerPrefix | None) -> int:
    """Leading tokens whose cached K/V needs no recomputation: the engine's prefix-cache hit,
    or a first segment stored at position 0 (nothing precedes it in either prompt), and the
    segments after it computed after exactly what precedes them now (their provenance, e.g.
    the first chunk after the same system part)."""
    exact = cached_prefix[0][0].shape[0] if cached_prefix is not None and cached_prefix[0] else 0
    for start, kv in task.hits:
        if start == 0 and kv.start_position == 0:
            exact = max(exact, kv.num_tokens)
    return exact_run(task.contexts, exact)
