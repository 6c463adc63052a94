"""The cached K/V a request reuses, every layer at once, keys re-rotated to the new positions.

A hit was computed with its first token at some other position; RoPE rotated its keys by that
position. Re-rotating them by the difference (``rope_rerotate_k``) gives the keys a computation at
the new positions would have, up to the context they saw. Rows of the engine's own prefix cache
were computed where they stand and are copied in unrotated.
"""

from __future__ import annotations

import torch

from lmcache_backend.blend.compute import BlendCompute
from lmcache_backend.blend.request import BlendMetadata


def cached_layers(meta: BlendMetadata, compute: BlendCompute) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's retrieved K/V, ``[L, T, Hkv, D]`` each, keys re-rotated to the new
    positions; built once per request (on first use) and kept in ``meta.cached_kv``."""
    if meta.cached_kv is not None:
        return meta.cached_kv
    model = compute.model
    num_tokens, layers = meta.positions.numel(), model.num_layers
    heads, dim = model.num_kv_heads, model.head_dim
    shape = (layers, num_tokens, heads, dim)
    stacked = meta.task.stacked(layers)
    if stacked is None:  # no store hit: only the cached prefix is reused
        keys = torch.zeros(shape, dtype=model.dtype, device=model.device)
        values = torch.zeros_like(keys)
    else:
        keys, values = stacked[0].view(shape), stacked[1].view(shape)
    original = meta.task.original_positions
    if meta.cached_prefix is not None:
        prefix_k, prefix_v = meta.cached_prefix
        n = prefix_k[0].shape[0]
        for layer in range(layers):
            keys[layer, :n] = prefix_k[layer].reshape(n, heads, dim)
            values[layer, :n] = prefix_v[layer].reshape(n, heads, dim)
        original = original.clone()
        original[:n] = meta.positions[:n]
    meta.timer.lap("load")
    _rerotate(keys, original, meta, compute)
    meta.timer.lap("rerotate")
    meta.cached_kv = (keys, values)
    return meta.cached_kv


def cached_layer(
    layer_id: int, meta: BlendMetadata, compute: BlendCompute
) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieved ``[T, Hkv, D]`` K/V of ``layer_id``, keys re-rotated to the new positions:
    views into the request's :func:`cached_layers` (the blend scatters into them)."""
    keys, values = cached_layers(meta, compute)
    return keys[layer_id], values[layer_id]


def _rerotate(
    keys: torch.Tensor,
    original: torch.Tensor,
    meta: BlendMetadata,
    compute: BlendCompute,
) -> None:
    """Turn the rows of ``keys`` (``[L, T, Hkv, D]``) computed at ``original [T]`` positions
    to ``meta.positions``, in place."""
    model, ops = compute.model, compute.ops
    layers, num_tokens, heads, dim = keys.shape
    moved = meta.valid_mask & (original != meta.positions)
    adapter_op = model.rope_rerotate_k  # the engine's own kernel, if it has one
    if adapter_op is not None and not ops.native("rope_rerotate_k"):
        if bool(moved.any()):
            # every row of every layer at once; a row that did not move turns by angle 0
            old = torch.where(moved, original, meta.positions)
            adapter_op(
                keys.view(layers * num_tokens, heads, dim),
                old.repeat(layers),
                meta.positions.repeat(layers),
            )
        return
    rows = torch.nonzero(moved, as_tuple=False).flatten()
    if rows.numel():
        # one call for all layers: a token's angle does not depend on the layer, so the
        # layers are extra heads of a [M, L * Hkv, D] view
        picked = keys[:, rows].transpose(0, 1).contiguous()
        ops.rope_rerotate_k(
            picked.view(rows.numel(), layers * heads, dim),
            original[rows],
            meta.positions[rows],
            model.cos_sin_cache,
            model.is_neox,
        )
        keys[:, rows] = picked.transpose(0, 1)
