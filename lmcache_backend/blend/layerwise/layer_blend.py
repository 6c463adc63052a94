"""One layer of a blend: the cached rows with the active tokens' fresh rows in, and, at a check
layer, the tokens that stay active (LMCache's ``process_qkv``).

Shapes: ``T`` tokens of the prompt, ``N`` active tokens, ``Hq``/``Hkv`` query/key-value heads,
``D`` head dim.
"""

from __future__ import annotations

import torch

from lmcache_backend.blend.compute import BlendCompute
from lmcache_backend.blend.layerwise.cached_kv import cached_layer
from lmcache_backend.blend.request import BlendMetadata
from lmcache_backend.blend.selectors.selection import (
    NEEDS_QUERY_ATTENTION,
    SCORERS,
    CheckInputs,
    query_attention_mass,
)
from lmcache_backend.ops.reference import select_topk_with_invalid, selection_count

# Score of exact-prefix tokens for the query-aware selections: below every other reusable token,
# above the uncached ones (-inf inside the top-k), so a ratio of 1.0 still recomputes them all.
LAST_RESORT = -torch.finfo(torch.float32).max


def blend_layer_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    residual: torch.Tensor | None,
    layer_id: int,
    attn_output: torch.Tensor | None,
    meta: BlendMetadata,
    compute: BlendCompute,
) -> tuple[
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]:
    """Blend one layer; ``meta`` is updated in place.

    Args:
        q: ``[N, Hq, D]``, k, v: ``[N, Hkv, D]`` fresh (post-RoPE) for the active tokens.
        residual: ``[N, hidden]`` hidden states of the active tokens before this layer, or None.
        layer_id: the layer.
        attn_output: optional ``[N, ...]`` buffer, reduced like ``q`` at a check layer.
        meta: the request's state.
        compute: the blender's model adapter and ops.

    Returns:
        ``(q, keys, values, residual, attn_output)``: q/residual/attn_output reduced to the
        tokens still active, and the blended ``[T, Hkv, D]`` K/V (None when the target holds
        them and nothing was retrieved, see ``BlendMetadata.cached_in_target``).
    """
    ops = compute.ops
    num_tokens = meta.positions.numel()
    all_active = meta.active.numel() == num_tokens
    is_check = layer_id in meta.schedule
    if meta.task is not None and (is_check or not all_active):
        if meta.cached_in_target and not is_check:
            # a streamed preview left every layer's cached rows in the target, where the
            # active rows' attention reads them: nothing to retrieve or blend here
            keys = values = None
        else:
            keys, values = cached_layer(layer_id, meta, compute)
    elif all_active:
        # Every row is about to be replaced by a fresh one: nothing to retrieve.
        keys, values = k, v
    else:  # pragma: no cover - a subset is active only after a check layer with a task
        raise AssertionError("active subset without cached K/V")
    if meta.config.blend_selection in NEEDS_QUERY_ATTENTION and meta.schedule:
        _accumulate_query_attention(layer_id, q, k, keys, meta, compute)
    if is_check:
        keep = _select(layer_id, k, v, keys, values, meta, compute)
        last = meta.active.numel() - 1
        if keep.numel() == 0 or int(keep[-1]) != last:  # the last token always stays
            keep = torch.cat([keep, torch.tensor([last], device=keep.device)])
        if layer_id == max(meta.schedule):  # the selection is final
            keep = meta.drop_tail(keep)
        meta.active = meta.active[keep]
        q, k, v = (ops.gather_rows(t, keep) for t in (q, k, v))
        if residual is not None:
            residual = ops.gather_rows(residual, keep)
        if attn_output is not None:
            attn_output = ops.gather_rows(attn_output, keep)
    if keys is not None and keys is not k:
        ops.scatter_rows(keys, meta.active, k)
        ops.scatter_rows(values, meta.active, v)
    if meta.stream is None:  # a streaming target keeps the blended rows itself
        meta.keys.append(keys)
        meta.values.append(values)
    meta.token_layers += meta.active.numel()
    return q, keys, values, residual, attn_output


def _accumulate_query_attention(
    layer_id: int,
    q: torch.Tensor,
    k: torch.Tensor,
    keys: torch.Tensor,
    meta: BlendMetadata,
    compute: BlendCompute,
) -> None:
    """Add this layer's attention mass from the query tokens to ``meta.query_attention``.

    Runs up to the last check layer only. Before the first check layer every token is fresh
    (``k`` holds them all); at a later check layer the keys are the cached rows with the
    active tokens' fresh rows in.
    """
    if layer_id > max(meta.schedule):
        return
    ops = compute.ops
    num_tokens = meta.positions.numel()
    query_rows = torch.nonzero(meta.active >= meta.query_start, as_tuple=False).flatten()
    if query_rows.numel() == 0:
        return
    if meta.active.numel() == num_tokens:
        current = k
    else:
        current = keys.clone()
        ops.scatter_rows(current, meta.active, k)
    mass = query_attention_mass(
        ops.gather_rows(q, query_rows),
        current,
        meta.positions[meta.active[query_rows]],
        compute.model.attn_scale,
        compute.model.sliding_window(layer_id),
    )
    meta.query_attention = mass if meta.query_attention is None else meta.query_attention + mass


def _select(
    layer_id: int,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: BlendMetadata,
    compute: BlendCompute,
) -> torch.Tensor:
    """Rows of the active tokens a check layer keeps (sorted ``[M]`` int64), before the last
    token is added."""
    ops = compute.ops
    ratio, selection = meta.schedule[layer_id], meta.config.blend_selection
    cached_k = ops.gather_rows(keys, meta.active)
    valid = meta.valid_mask[meta.active]
    if selection == "kv_deviation":  # LMCache's selection, on the backend's fused op
        return ops.kv_deviation_topk(k, cached_k, valid, ratio, meta.num_reusable)
    inputs = CheckInputs(
        k_fresh=k,
        v_fresh=v,
        k_cached=cached_k,
        v_cached=ops.gather_rows(values, meta.active),
        valid=valid,
        query_attention=None if meta.query_attention is None else meta.query_attention[meta.active],
    )
    scores = compute.agreed(SCORERS[selection](inputs))
    scores = scores.masked_fill(meta.active < meta.exact_prefix, LAST_RESORT)
    count = selection_count(ratio, int(valid.sum()), meta.num_reusable)
    return select_topk_with_invalid(scores, valid, count)
