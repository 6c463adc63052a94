"""What the blender asks of the engine it blends for: :class:`KVTarget`.

The blender computes with a model adapter (:mod:`lmcache_backend.models.base`) and the op registry;
the target is where each layer's blended K/V go, and it declares what more its engine can do.
Every call goes from the blender down to the target; a target never calls the blender. The only
thing handed down to be called back is the preview's per-layer attention (:data:`PreviewAttend`),
a plain function of its arguments.

Three kinds of target:

* the base class itself (:data:`NO_TARGET`): nothing is written; the blended K/V of every layer
  are in :class:`~lmcache_backend.blend.request.BlendResult` (the HF engine, tests);
* a **layer writer** (``write_layer``): receives each finished layer's ``[T, Hkv, D]`` K/V;
* a **paged target** (``paged_attention``): an engine's paged cache. The blender writes each
  layer's rows as soon as they are known (every cached row once, then each layer's computed rows)
  and asks the target for the selected queries' attention over what it wrote. It may also run
  the engine's own forward pass of a fixed selection (``runs_engine_forward``) and of a preview
  (``preview_rows``).

Shapes: ``T`` tokens of the prompt, ``N`` rows, ``L`` layers, ``Hq``/``Hkv`` query/key-value
heads, ``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: ``attend(layer_id, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D]``: one layer's
#: attention of a preview's tokens given their fresh rows (the blender attends over its cached
#: K/V and sums the attention mass the selection needs).
PreviewAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class KVTarget:
    """Where a blend's K/V go, and what the engine behind it can do.

    The base class keeps nothing and can do nothing more; an engine's target overrides what it
    serves and sets the matching flags.

    Attributes:
        paged_attention: rows go in with :meth:`write_rows` and the selected queries attend
            over them with :meth:`attention`; else each finished layer goes to
            :meth:`write_layer` and attention runs on the op registry.
        runs_engine_forward: :meth:`forward_rows` can compute a fixed selection's rows in the
            engine's own forward pass (a paged target only).
        streams_layers: a paged target that keeps every row written to it and needs no
            contiguous copy of them (its attention reads the rows where they are): the blender
            then holds the cached K/V of one layer at a time (each layer's cached rows are
            written just before the layer is computed) instead of every layer's, and the
            blended K/V stay in the target only (the result's ``keys``/``values`` are empty).
    """

    paged_attention: bool = False
    runs_engine_forward: bool = False
    streams_layers: bool = False

    def write_layer(self, layer_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``keys``, ``values``: ``[T, Hkv, D]`` of every token of the request, final."""

    def write_rows(
        self, layer_id: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """``keys``, ``values``: ``[N, Hkv, D]`` of the sorted token indices ``rows [N]``."""
        raise NotImplementedError(f"{type(self).__name__} is not a paged target")

    def attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at sorted ``positions [N]`` over the written keys ``0..p`` of each
        query -> ``[N, Hq, D]``. ``keys``/``values`` ``[T, Hkv, D]``: the same rows as the
        layer's written ones, contiguous (a target may attend over them instead); None for a
        target that ``streams_layers``. ``window``: the layer's sliding window (keys
        ``p - window + 1 .. p``), passed only for a model whose layer has one."""
        raise NotImplementedError(f"{type(self).__name__} is not a paged target")

    def forward_rows(
        self,
        rows: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Tokens ``rows [N]`` (``token_ids [N]`` at sorted ``positions [N]``) through every
        layer of the engine's forward pass, writing their rows; every other row is already
        written. ``kv``: the request's blended K/V, ``[L, T, Hkv, D]`` each, as written."""
        raise NotImplementedError(f"{type(self).__name__} runs no forward pass")

    def preview_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: PreviewAttend
    ) -> bool:
        """Tokens ``token_ids [N]`` at sorted ``positions [N]`` through every layer of the
        engine's forward pass, layer ``l``'s attention being ``attend(l, q, k, v)`` of their
        fresh rows; writes nothing. False when it did not run (the blender then runs the preview
        layer by layer with the model adapter)."""
        return False


#: the target that keeps nothing: results stay in the blender's result
NO_TARGET = KVTarget()

#: LMCache's name for a target that receives each finished layer (``gpu_connector``)
KVLayerWriter = KVTarget


class _LayerWriter(KVTarget):
    """A duck-typed layer writer (an object with LMCache's ``write_layer`` only) as a target."""

    def __init__(self, writer: object) -> None:
        self._writer = writer

    def write_layer(self, layer_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._writer.write_layer(layer_id, keys, values)


def as_target(writer: object | None) -> KVTarget:
    """``writer`` as a :class:`KVTarget`: None keeps nothing (:data:`NO_TARGET`); an object that
    is not a target is taken as a layer writer (its ``write_layer`` receives each layer)."""
    if writer is None:
        return NO_TARGET
    if isinstance(writer, KVTarget):
        return writer
    return _LayerWriter(writer)
