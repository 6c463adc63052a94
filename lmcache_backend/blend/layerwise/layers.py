"""The layer loop of a blend: every layer for the request's active tokens, with the blended K/V
going into the request's :class:`~lmcache_backend.blend.engine_side.KVTarget` as each layer is
final.

Shapes: ``T`` tokens of the prompt, ``N`` active tokens, ``L`` layers, ``Hkv`` key-value heads,
``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from lmcache_backend.blend.compute import BlendCompute
from lmcache_backend.blend.engine_side import KVTarget
from lmcache_backend.blend.layerwise.cached_kv import cached_layer, cached_layers
from lmcache_backend.blend.layerwise.layer_blend import blend_layer_kv
from lmcache_backend.blend.request import BlendMetadata
from lmcache_backend.blend.selectors.preview_mass import PreviewMass
from lmcache_backend.models.base import window_kwargs

#: profile names of each layer kind's phases
_PHASE_NAMES = {
    p: (f"{p}: rest", f"{p}: attention") for p in ("full", "check", "selected", "preview")
}


def run_layers(
    meta: BlendMetadata,
    token_ids: torch.Tensor,
    target: KVTarget,
    compute: BlendCompute,
    mass: PreviewMass | None = None,
    last_output: bool = True,
) -> Generator[int, None, torch.Tensor | None]:
    """Every layer for ``meta``'s active tokens, yielding each finished layer id; returns the
    last layer's hidden states ``[N, hidden]`` (None when no token was active, or when
    ``last_output`` is False: then the last layer computes only what its K/V and ``mass`` need,
    not the attention output, o_proj and MLP nothing would read). ``mass``, when given (a
    preview), receives the value-weighted attention mass of every layer.

    With a paged target each layer's rows go into the engine's paged cache and attention runs
    there (a target that ``streams_layers`` receives each layer's cached rows from the
    request's :class:`~lmcache_backend.blend.layerwise.cached_kv.LayerStream`, then its computed
    rows); otherwise attention runs on the op registry's ``attention_at_positions`` and the target
    receives each finished layer. A fixed selection without logits runs through the engine's own
    forward pass where the target offers one."""
    model, ops, timer = compute.model, compute.ops, meta.timer
    if (
        not last_output
        and mass is None
        and not meta.schedule
        and meta.task is not None
        and meta.active.numel()
        and target.runs_engine_forward
    ):
        yield from _engine_forward(meta, token_ids, target, compute)
        return None
    # all tokens unless a fixed selection (which may leave nothing before compute_end)
    hidden = model.embed(token_ids[meta.active.cpu()]) if meta.active.numel() else None
    first_check = min(meta.schedule, default=model.num_layers)
    paged = target.paged_attention
    cached_written = False
    # the active rows' positions, taken once per set of active rows (a check layer changes
    # it): the adapter's rotary angles and the target's slots are looked up once per tensor
    rows, positions = meta.active, meta.positions[meta.active]
    for layer in range(model.num_layers):
        if meta.active.numel() == 0:
            # nothing left to compute before compute_end: the layers hold the cached rows
            if meta.stream is not None:
                if not meta.cached_in_target:
                    cached_layer(layer, meta, compute)  # the stream writes its rows
                yield layer
                continue
            keys, values = cached_layer(layer, meta, compute)
            meta.keys.append(keys)
            meta.values.append(values)
            if paged and not cached_written:
                write_cached_rows(target, layer, meta, compute)
                cached_written = True
            elif not paged:
                target.write_layer(layer, keys, values)
            timer.lap("write-back")
            yield layer
            continue
        phase = (
            "preview"
            if mass is not None
            else "check"
            if layer in meta.schedule
            else "selected"
            if layer > first_check or meta.active.numel() < meta.positions.numel()
            else "full"
        )
        rest, attention = _PHASE_NAMES[phase]
        if meta.active is not rows:
            rows, positions = meta.active, meta.positions[meta.active]
        x = model.attention_input(layer, hidden)
        q, k, v = model.qkv(layer, x, positions)
        timer.lap(rest)
        q, keys, values, hidden, _ = blend_layer_kv(q, k, v, hidden, layer, None, meta, compute)
        timer.lap("select and blend")
        if meta.active is not rows:  # a check layer kept some of the rows
            rows, positions = meta.active, meta.positions[meta.active]
        if paged:
            if meta.cached_kv is not None and not cached_written:
                write_cached_rows(target, layer, meta, compute)
                cached_written = True
            elif layer in meta.schedule:  # a later check layer: the kept rows
                rows = meta.active
                target.write_rows(
                    layer, rows, ops.gather_rows(keys, rows), ops.gather_rows(values, rows)
                )
            else:  # the computed rows
                target.write_rows(layer, meta.active, k, v)
            timer.lap("write-back")
        output = last_output or layer < model.num_layers - 1
        if meta.active.numel() == 0:  # the check layer kept nothing before compute_end
            hidden = None
        elif not output and mass is None:  # its K/V are written; nothing reads more
            hidden = None
        else:
            window = window_kwargs(model, layer)
            if mass is not None:  # the preview: attention and the query's mass at once
                attn = mass.attend(layer, q, keys, values, meta, model.attn_scale, **window)
            elif paged:  # a window goes to the target only for a sliding-window layer
                attn = target.attention(
                    layer, q, positions, model.attn_scale, keys, values, **window
                )
            else:
                attn = ops.attention_at_positions(
                    q, keys, values, positions, model.attn_scale, **window
                )
            timer.lap(attention)
            if output:
                hidden = hidden + model.attention_output(layer, attn)
                hidden = model.mlp_block(layer, hidden)
                timer.lap(rest)
            else:  # the preview's last layer: only its attention mass is used
                hidden = None
        if not paged:
            target.write_layer(layer, keys, values)
            timer.lap("write-back")
        yield layer
    return hidden


def write_cached_rows(
    target: KVTarget, first: int, meta: BlendMetadata, compute: BlendCompute
) -> None:
    """Every cached row of layers ``first..L-1`` into ``target``, once per request (the
    computed rows of each layer overwrite theirs as they come)."""
    every = torch.arange(meta.positions.numel(), device=meta.positions.device)
    for layer in range(first, compute.model.num_layers):
        cached_k, cached_v = cached_layer(layer, meta, compute)
        target.write_rows(layer, every, cached_k, cached_v)


def _engine_forward(
    meta: BlendMetadata, token_ids: torch.Tensor, target: KVTarget, compute: BlendCompute
) -> Generator[int, None, None]:
    """A fixed selection without logits through the engine's own forward pass: every cached
    row of every layer into the paged cache, then the selected tokens computed there in one
    pass (they overwrite their rows layer by layer, as the layer-by-layer path does). The
    blended K/V stay in the engine's cache: ``meta.keys``/``values`` stay empty."""
    write_cached_rows(target, 0, meta, compute)
    meta.timer.lap("write-back")
    active = meta.active.cpu()
    # the blended K/V of every layer, as the paged cache now holds them: a tiled kernel
    # attends over these (the pass writes each layer's selected rows into both)
    kv = cached_layers(meta, compute)
    target.forward_rows(active, token_ids[active], meta.positions[meta.active], kv)
    meta.token_layers += active.numel() * compute.model.num_layers
    meta.timer.lap("selected: engine forward")
    yield from range(compute.model.num_layers)
