"""The cached K/V a request reuses, every layer at once, keys re-rotated to the new positions.

A hit was computed with its first token at some other position; RoPE rotated its keys by that
position. Re-rotating them by the difference (``rope_rerotate_k``) gives the keys a computation at
the new positions would have, up to the context they saw. Rows of the engine's own prefix cache
were computed where they stand and are copied in unrotated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_backend.blend.compute import BlendCompute
from lmcache_backend.blend.engine_side import KVTarget
from lmcache_backend.blend.layerwise.layer_load import STAGED, LayerLoader
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


@dataclass(frozen=True)
class Rerotation:
    """Which cached rows a request turns, from where to where: the same in every layer, found
    once per request (finding the moved rows reads them back from the device).

    Attributes:
        rows: ``[M]`` the rows that moved (the op registry turns these); None: every row,
            those that did not move by angle 0 (the engine's kernel, whose table at angle 0
            is exact), or none when ``moved`` is False.
        old, new: ``[M]`` (or ``[T]`` with ``rows`` None) positions before and after.
        moved: whether any row moved.
    """

    rows: torch.Tensor | None
    old: torch.Tensor
    new: torch.Tensor
    moved: bool


def plan_rerotation(
    original: torch.Tensor, meta: BlendMetadata, compute: BlendCompute
) -> Rerotation:
    """The :class:`Rerotation` of rows computed at ``original [T]`` positions to
    ``meta.positions``: by the model's own kernel where it has one and the op registry does
    not serve the op natively, else by the op registry over the moved rows."""
    moved = meta.valid_mask & (original != meta.positions)
    if _engine_kernel(compute) is not None:
        old = torch.where(moved, original, meta.positions)
        return Rerotation(None, old, meta.positions, bool(moved.any()))
    rows = torch.nonzero(moved, as_tuple=False).flatten()
    return Rerotation(rows, original[rows], meta.positions[rows], rows.numel() > 0)


def _engine_kernel(compute: BlendCompute):
    """The model's own re-rotation kernel, where it turns the keys (see :func:`_rerotate`)."""
    adapter_op = compute.model.rope_rerotate_k
    if adapter_op is not None and not compute.ops.native("rope_rerotate_k"):
        return adapter_op
    return None


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
    rerotate(keys, plan_rerotation(original, meta, compute), compute, layer_ids)


def rerotate(
    keys: torch.Tensor,
    plan: Rerotation,
    compute: BlendCompute,
    layer_ids: list[int] | None = None,
) -> None:
    """Turn ``keys`` (``[L', T, Hkv, D]``: layers ``layer_ids``, default every layer) as
    ``plan`` says, in place; each layer with its own rotation table (one call per distinct
    table). Waits for nothing on the device."""
    if not plan.moved:
        return
    model, ops = compute.model, compute.ops
    layers, num_tokens, heads, dim = keys.shape
    layer_ids = list(range(layers)) if layer_ids is None else layer_ids
    groups = model.rotation_groups()
    where = {layer: i for i, layer in enumerate(layer_ids)}
    adapter_op = _engine_kernel(compute)  # the engine's own kernel, if it has one
    if adapter_op is not None:
        # every row of a table's layers at once; a row that did not move turns by angle 0
        for table, group in groups:
            index = [where[layer] for layer in group if layer in where]
            if not index:
                continue
            whole = len(index) == layers  # one table for every layer: turn ``keys`` itself
            picked = keys if whole else keys[index].contiguous()  # [L_g, T, Hkv, D], a copy
            adapter_op(
                picked.view(len(index) * num_tokens, heads, dim),
                plan.old.repeat(len(index)) if len(index) > 1 else plan.old,
                plan.new.repeat(len(index)) if len(index) > 1 else plan.new,
                table,
            )
            if not whole:
                keys[index] = picked
        return
    rows = plan.rows
    assert rows is not None  # the op registry's plan names the moved rows
    for table, group in groups:
        picked_layers = [where[layer] for layer in group if layer in where]
        if not picked_layers:
            continue
        # one call per table: a token's angle does not depend on the layer, so the layers
        # are extra heads of a [M, L * Hkv, D] view
        if len(picked_layers) == 1:  # one layer: its rows, already [M, Hkv, D] contiguous
            layer = keys[picked_layers[0]]
            picked = layer[rows]
            ops.rope_rerotate_k(picked, plan.old, plan.new, table, model.is_neox)
            layer[rows] = picked
            continue
        if len(picked_layers) == layers:  # every layer: plain row indexing
            index = slice(None)
            picked = keys[:, rows].transpose(0, 1).contiguous()
        else:
            index = torch.tensor(picked_layers, device=keys.device)[:, None]
            picked = keys[index, rows[None, :]].transpose(0, 1).contiguous()
        ops.rope_rerotate_k(
            picked.view(rows.numel(), len(picked_layers) * heads, dim),
            plan.old,
            plan.new,
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

    A layer arrives in one copy for K and one for V, the next layer's while the current one
    computes (:class:`~lmcache_backend.blend.layerwise.layer_load.LayerLoader`: on CUDA from
    page-locked host memory on a side stream). What every layer shares -- the rows that moved and
    their positions, the rows' slots in the target -- is found once, so handing out a layer waits
    for nothing on the device.

    Args:
        meta: the request (its ``task``, ``cached_prefix``, positions and valid rows).
        compute: the model adapter and ops.
        target: where each layer's cached rows go.
        host_load: how hits in host memory reach the device (``LayerLoader``'s).
    """

    def __init__(
        self,
        meta: BlendMetadata,
        compute: BlendCompute,
        target: KVTarget,
        host_load: str = STAGED,
    ) -> None:
        model = compute.model
        self.meta, self.compute, self.target = meta, compute, target
        shape = (meta.positions.numel(), model.num_kv_heads, model.head_dim)
        assert meta.task is not None  # a stream is opened for a request that reuses something

        def empty() -> torch.Tensor:
            return torch.empty(shape, dtype=model.dtype, device=model.device)

        buffers = [(empty(), empty()) for _ in range(2)]
        self._loader = LayerLoader(
            meta.task.hits, model.num_layers, shape[0], buffers, host_load=host_load
        )
        self._current = -1  # the layer last handed out (re-rotated and written)
        self._every = torch.arange(shape[0], device=meta.positions.device)
        # where each row was computed and where it goes: the same for every layer
        self._rotation = plan_rerotation(_original_positions(meta), meta, compute)
        self._loader.start(0)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s cached K/V ``[T, Hkv, D]``, re-rotated and written into the
        target; valid until the layer after next is asked for (the caller may scatter into
        them: the target already holds the cached rows)."""
        if self._current == layer_id:
            return self._loader.buffers[layer_id % 2]
        keys, values = self._loader.wait(layer_id)
        self.meta.timer.lap("load")
        _fill_prefix(keys, values, self.meta, layer_id)
        rerotate(keys.unsqueeze(0), self._rotation, self.compute, [layer_id])
        self.meta.timer.lap("rerotate")
        self.target.write_rows(layer_id, self._every, keys, values)
        self.meta.timer.lap("write-back")
        self._current = layer_id
        self._loader.start(layer_id + 1)  # overlaps this layer's compute
        return keys, values

    def close(self) -> None:
        """Stop the loader (once the request no longer asks for layers)."""
        self._loader.close()


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
