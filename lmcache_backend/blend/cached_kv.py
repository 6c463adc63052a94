"""The cached K/V a request reuses, every layer at once, keys re-rotated to the new positions.

A hit was computed with its first token at some other position; RoPE rotated its keys by that
position. Re-rotating them by the difference (``rope_rerotate_k``) gives the keys a computation at
the new positions would have, up to the context they saw. Rows of the engine's own prefix cache
were computed where they stand and are copied in unrotated.
"""

from __future__ import annotations

import torch

from lmcache_backend.blend.compute import BlendCompute
from lmcache_backend.blend.engine_side import KVTarget
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
    for layer in range(layers):
        _fill_prefix(keys[layer], values[layer], meta, layer)
    meta.timer.lap("load")
    _rerotate(keys, _original_positions(meta), meta, compute)
    meta.timer.lap("rerotate")
    meta.cached_kv = (keys, values)
    return meta.cached_kv


def cached_layer(
    layer_id: int, meta: BlendMetadata, compute: BlendCompute
) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieved ``[T, Hkv, D]`` K/V of ``layer_id``, keys re-rotated to the new positions:
    views into the request's :func:`cached_layers` (the blend scatters into them), or, when the
    request streams its layers, the :class:`LayerStream`'s buffers of that layer."""
    if meta.stream is not None:
        return meta.stream.layer(layer_id)
    keys, values = cached_layers(meta, compute)
    return keys[layer_id], values[layer_id]


def _rerotate(
    keys: torch.Tensor,
    original: torch.Tensor,
    meta: BlendMetadata,
    compute: BlendCompute,
    layer_ids: list[int] | None = None,
) -> None:
    """Turn the rows of ``keys`` (``[L', T, Hkv, D]``: layers ``layer_ids``, default every
    layer) computed at ``original [T]`` positions to ``meta.positions``, in place; each layer
    with its own rotation table (one call per distinct table)."""
    model, ops = compute.model, compute.ops
    layers, num_tokens, heads, dim = keys.shape
    layer_ids = list(range(layers)) if layer_ids is None else layer_ids
    moved = meta.valid_mask & (original != meta.positions)
    groups = model.rotation_groups()
    where = {layer: i for i, layer in enumerate(layer_ids)}
    adapter_op = model.rope_rerotate_k  # the engine's own kernel, if it has one
    if adapter_op is not None and not ops.native("rope_rerotate_k"):
        if not bool(moved.any()):
            return
        # every row of a table's layers at once; a row that did not move turns by angle 0
        old = torch.where(moved, original, meta.positions)
        for table, group in groups:
            index = [where[layer] for layer in group if layer in where]
            if not index:
                continue
            whole = len(index) == layers  # one table for every layer: turn ``keys`` itself
            picked = keys if whole else keys[index].contiguous()  # [L_g, T, Hkv, D], a copy
            adapter_op(
                picked.view(len(index) * num_tokens, heads, dim),
                old.repeat(len(index)),
                meta.positions.repeat(len(index)),
                table,
            )
            if not whole:
                keys[index] = picked
        return
    rows = torch.nonzero(moved, as_tuple=False).flatten()
    if rows.numel() == 0:
        return
    for table, group in groups:
        picked_layers = [where[layer] for layer in group if layer in where]
        if not picked_layers:
            continue
        # one call per table: a token's angle does not depend on the layer, so the layers
        # are extra heads of a [M, L * Hkv, D] view
        if len(picked_layers) == layers:  # every layer: plain row indexing
            index = slice(None)
            picked = keys[:, rows].transpose(0, 1).contiguous()
        else:
            index = torch.tensor(picked_layers, device=keys.device)[:, None]
            picked = keys[index, rows[None, :]].transpose(0, 1).contiguous()
        ops.rope_rerotate_k(
            picked.view(rows.numel(), len(picked_layers) * heads, dim),
            original[rows],
            meta.positions[rows],
            table,
            model.is_neox,
        )
        if isinstance(index, slice):
            keys[:, rows] = picked.transpose(0, 1)
        else:
            keys[index, rows[None, :]] = picked.transpose(0, 1)


class LayerStream:
    """The cached K/V of one request, one layer at a time, for a target that
    ``streams_layers``: each layer's rows (retrieved, the cached prefix filled in, keys
    re-rotated) are written into the target the first time the layer is asked for, and only two
    layers are ever held (``2 x 2 x [T, Hkv, D]`` in the model's dtype).

    On CUDA the next layer's copies from the store run on a side stream, from page-locked host
    memory where the store keeps it, while the current layer computes; elsewhere they run when
    the layer is asked for.

    Args:
        meta: the request (its ``task``, ``cached_prefix``, positions and valid rows).
        compute: the model adapter and ops.
        target: where each layer's cached rows go.
    """

    def __init__(self, meta: BlendMetadata, compute: BlendCompute, target: KVTarget) -> None:
        model = compute.model
        self.meta, self.compute, self.target = meta, compute, target
        shape = (meta.positions.numel(), model.num_kv_heads, model.head_dim)
        self._buffers = [
            tuple(torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(2))
            for _ in range(2)
        ]
        self._layer_in = [-1, -1]  # which layer each buffer holds (after its copy)
        self._ready: list[torch.cuda.Event | None] = [None, None]
        self._current = -1  # the layer last handed out (re-rotated and written)
        self._side = torch.cuda.Stream(device=model.device) if model.device.type == "cuda" else None
        self._every = torch.arange(shape[0], device=meta.positions.device)
        # where each row was computed: the same for every layer
        self._original = _original_positions(meta)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s cached K/V ``[T, Hkv, D]``, re-rotated and written into the
        target; valid until the layer after next is asked for (the caller may scatter into
        them: the target already holds the cached rows)."""
        slot = layer_id % 2
        keys, values = self._buffers[slot]
        if self._current == layer_id:
            return keys, values
        if self._layer_in[slot] != layer_id:
            self._fetch(layer_id, slot)
        if self._ready[slot] is not None:
            torch.cuda.current_stream(keys.device).wait_event(self._ready[slot])
        self.meta.timer.lap("load")
        _fill_prefix(keys, values, self.meta, layer_id)
        _rerotate(keys.unsqueeze(0), self._original, self.meta, self.compute, [layer_id])
        self.meta.timer.lap("rerotate")
        self.target.write_rows(layer_id, self._every, keys, values)
        self.meta.timer.lap("write-back")
        self._current = layer_id
        if layer_id + 1 < self.compute.model.num_layers:
            self._fetch(layer_id + 1, 1 - slot)  # overlaps this layer's compute on CUDA
        return keys, values

    def _fetch(self, layer_id: int, slot: int) -> None:
        keys, values = self._buffers[slot]
        task = self.meta.task
        if self._side is None:
            task.fill_layer(layer_id, keys, values)
            self._ready[slot] = None
        else:
            # the buffer's previous layer may still be read by work queued on the compute stream
            self._side.wait_stream(torch.cuda.current_stream(keys.device))
            with torch.cuda.stream(self._side):
                task.fill_layer(layer_id, keys, values, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._side)
            self._ready[slot] = event
        self._layer_in[slot] = layer_id


def _fill_prefix(
    keys: torch.Tensor, values: torch.Tensor, meta: BlendMetadata, layer_id: int
) -> None:
    """The engine's own prefix rows of ``layer_id`` into ``keys``/``values`` ``[T, Hkv, D]``."""
    if meta.cached_prefix is None:
        return
    prefix_k, prefix_v = meta.cached_prefix
    n = prefix_k[0].shape[0]
    keys[:n] = prefix_k[layer_id].reshape(n, *keys.shape[1:])
    values[:n] = prefix_v[layer_id].reshape(n, *values.shape[1:])


def _original_positions(meta: BlendMetadata) -> torch.Tensor:
    """``[T]`` positions the cached rows were computed at (the prefix's: where they stand)."""
    original = meta.task.original_positions
    if meta.cached_prefix is None:
        return original
    n = meta.cached_prefix[0][0].shape[0]
    original = original.clone()
    original[:n] = meta.positions[:n]
    return original
