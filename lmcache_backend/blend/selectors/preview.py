"""The preview selections (``query_preview``, ``query_preview_last``): choose the recomputed
tokens before the blend by running the query tokens alone over the cached K/V.

The query tokens (and any uncached ones) run through every layer over the cached K/V, as naive
reuse computes them; the reusable tokens that contribute most to their attention outputs
(attention mass times value norm, summed over layers) are recomputed in every layer of the blend
that follows (see :mod:`lmcache_backend.blend.selectors.selection` for the score).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from lmcache_backend.blend.compute import BlendCompute
from lmcache_backend.blend.engine_side import NO_TARGET, KVTarget
from lmcache_backend.blend.layerwise.layer_blend import LAST_RESORT, blend_layer_kv
from lmcache_backend.blend.layerwise.layers import run_layers
from lmcache_backend.blend.request import BlendMetadata
from lmcache_backend.blend.selectors.preview_mass import PreviewMass
from lmcache_backend.blend.selectors.read_share import count_for_read_share, read_share
from lmcache_backend.blend.selectors.selection import (
    QUERY_PREVIEW_LAST,
    QUERY_PREVIEW_STALE,
    chunk_heads,
    first_scored_layer,
    heads_first,
    position_discount,
    query_and_last_scores,
    scored_layers,
    span_ranked,
)
from lmcache_backend.blend.selectors.staleness import (
    attention_shares,
    count_for_divergence,
    divergence,
    token_staleness,
)
from lmcache_backend.ops.reference import select_topk_with_invalid, selection_count


def preview_selection(
    meta: BlendMetadata, token_ids: torch.Tensor, target: KVTarget, compute: BlendCompute
) -> Generator[int, None, None]:
    """Choose the recomputed tokens, yielding each finished preview layer id (nothing when there
    is nothing to choose; only the last one when ``target``'s engine ran the preview, see
    :meth:`~lmcache_backend.blend.engine_side.KVTarget.preview_rows`).

    ``meta`` is switched to that fixed selection in place and keeps the preview's re-rotated
    cached K/V (``cached_kv``: the blend would retrieve the same rows again; the rows the preview
    computed are active again and overwritten) and its token-layers.
    """
    config = meta.config
    valid = meta.valid_mask
    count = selection_count(config.final_ratio(), int(valid.sum()), meta.num_reusable)
    chosen = ~valid
    chosen[-1] = True
    if count == 0:  # naive reuse: nothing to choose, no preview
        meta.fix_selection(chosen)
        return
    # The preview runs the query tail alone: the uncached tokens before it (chunk edges, new
    # text) are left out of its keys and computed once, in the blend that follows, instead of
    # twice (measured: a preview over 1,000 such tokens of a 4k prompt cost more than a full
    # prefill). Their own attention mass is never needed: they are always recomputed.
    previewed = chosen.clone()
    previewed[: meta.query_start] = False
    previewed[-1] = True
    preview = BlendMetadata(
        positions=meta.positions,
        active=torch.nonzero(previewed, as_tuple=False).flatten(),
        valid_mask=valid,
        num_reusable=meta.num_reusable,
        schedule={},
        task=meta.task,
        config=config,
        query_start=meta.query_start,
        cached_prefix=meta.cached_prefix,
        timer=meta.timer,
        stream=meta.stream,
    )
    mass = PreviewMass(
        meta.positions.numel(),
        valid.device,
        config.blend_selection in (QUERY_PREVIEW_LAST, QUERY_PREVIEW_STALE),
        scored_layers(
            compute.model.layer_windows(),
            meta.positions.numel(),
            first_scored_layer(config.blend_preview_scored_from, compute.model.num_layers),
            config.blend_preview_scored_layers,
        ),
    )
    if _engine_preview(preview, token_ids, target, compute, mass):
        yield compute.model.num_layers - 1
    else:
        # the preview writes nothing: the target's rows are the blend's
        yield from run_layers(preview, token_ids, NO_TARGET, compute, mass, last_output=False)
    scores = compute.agreed(mass.query)
    last = None if mass.last is None else compute.agreed(mass.last)
    candidates = valid.clone()  # the tokens the selection may choose
    candidates[: meta.exact_prefix] = False
    if last is not None:
        scores = query_and_last_scores(scores, last, candidates)
    reads = scores.clone()  # what the question reads of each token, before the ranking adjusts it
    # how stale each token's K/V may be, from what the store recorded (blend/selectors/staleness.py)
    stale = token_staleness(meta, scores.device)
    shares = attention_shares(compute.agreed(mass.last_reads))
    if config.blend_selection == QUERY_PREVIEW_STALE:
        scores = scores * stale
    if config.blend_position_discount > 0:
        discount = position_discount(
            meta.positions.to(scores.device), config.blend_position_discount
        )
        scores = scores / discount
    if config.blend_min_read_share > 0:
        most = selection_count(
            config.blend_max_recompute_ratio, int(valid.sum()), meta.num_reusable
        )
        count = count_for_read_share(
            reads, scores, candidates, config.blend_min_read_share, count, most
        )
    if config.blend_max_divergence > 0:
        most = selection_count(
            config.blend_max_recompute_ratio, int(valid.sum()), meta.num_reusable
        )
        count = count_for_divergence(
            shares, stale, scores, candidates, config.blend_max_divergence, count, most
        )
    if config.blend_selection_span > 1:
        scores = span_ranked(scores, candidates, config.blend_selection_span)
    if config.blend_chunk_head_tokens > 0:
        hits = [(start, kv.num_tokens) for start, kv in meta.task.hits]
        heads = chunk_heads(hits, scores.numel(), config.blend_chunk_head_tokens)
        scores = heads_first(scores, heads.to(scores.device) & candidates)
    scores[: meta.exact_prefix] = LAST_RESORT
    chosen[select_topk_with_invalid(scores, valid, count)] = True
    meta.read_share = read_share(reads, chosen, candidates)
    meta.divergence = divergence(shares, stale, chosen)
    meta.cached_kv = preview.cached_kv
    # a streamed preview wrote every layer's cached rows into the target on its way
    meta.cached_in_target = meta.stream is not None
    meta.token_layers = preview.token_layers
    meta.fix_selection(chosen)


def _engine_preview(
    preview: BlendMetadata,
    token_ids: torch.Tensor,
    target: KVTarget,
    compute: BlendCompute,
    mass: PreviewMass,
) -> bool:
    """The preview's layers through the engine's own forward pass (its compiled layer glue and
    products), each layer's attention and mass computed here as :func:`run_layers` computes
    them; False when the target's engine cannot run it."""
    timer = preview.timer
    scale = compute.model.attn_scale

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        timer.lap("preview: engine forward")
        q, keys, values, _, _ = blend_layer_kv(q, k, v, None, layer, None, preview, compute)
        timer.lap("select and blend")
        attn = mass.attend(
            layer, q, keys, values, preview, scale, compute.model.sliding_window(layer)
        )
        timer.lap("preview: attention")
        return attn

    active = preview.active.cpu()
    ran = bool(target.preview_rows(token_ids[active], preview.positions[preview.active], attend))
    if ran:
        timer.lap("preview: engine forward")
    return ran
