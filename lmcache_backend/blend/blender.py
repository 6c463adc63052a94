"""``LMCBlender``: CacheBlend over a model adapter and the op registry.

One request, ``T`` tokens at positions ``0..T-1``:

1. split the tokens on the separator and look the segments up (hits give per-layer K/V computed
   at other positions, ``valid_mask`` marks their rows): :mod:`~lmcache_backend.blend.planning`;
2. choose the tokens to recompute: a preview of the query over the cached K/V
   (:mod:`~lmcache_backend.blend.selectors.preview`, the default), or at check layers
   (:mod:`~lmcache_backend.blend.layerwise.layer_blend`: keep the ``ratio * num_reusable`` valid
   tokens that score highest, plus every uncached token and the last token);
3. layer by layer (:mod:`~lmcache_backend.blend.layerwise.layers`), compute fresh q/k/v for the
   active tokens; the blended K/V are the cached rows, keys re-rotated to the new positions
   (:mod:`~lmcache_backend.blend.layerwise.cached_kv`), with the active tokens' fresh rows scattered
   in; each active query at position ``p`` attends keys ``0..p`` of them (exact causal mask);
4. o_proj and MLP run for the active tokens only; the last token's logits come out at the end.

The request (:class:`~lmcache_backend.blend.request.BlendRequest`) carries its own settings, so
one blender serves every request of an engine. The blended K/V go to the request's
:class:`~lmcache_backend.blend.engine_side.KVTarget` (e.g. an engine's paged cache) or come back
in the :class:`~lmcache_backend.blend.request.BlendResult`.

An engine that computes the prompt's tail itself (the vLLM connector leaves it the question)
passes ``compute_end``: once the selection is fixed, only active tokens before it are computed,
and the blend produces the K/V of tokens ``0..compute_end-1`` and no logits.

With fewer reusable tokens than ``blend_min_tokens`` (or a prompt longer than the model's exact
attention span) the same loop runs with every token active: a full prefill, logged.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from lmcache_backend.blend.compute import BlendCompute, ScoreReducer
from lmcache_backend.blend.engine_side import KVTarget, as_target
from lmcache_backend.blend.layerwise.cached_kv import LayerStream
from lmcache_backend.blend.layerwise.layer_blend import blend_layer_kv
from lmcache_backend.blend.layerwise.layer_load import STAGED
from lmcache_backend.blend.layerwise.layers import run_layers
from lmcache_backend.blend.planning import plan_request
from lmcache_backend.blend.request import (  # noqa: F401 - REQUEST_FIELDS: public name
    REQUEST_FIELDS,
    BlendMetadata,
    BlendRequest,
    BlendResult,
)
from lmcache_backend.blend.segments.retriever import SPTBlendRetriever
from lmcache_backend.blend.selectors.preview import preview_selection
from lmcache_backend.blend.selectors.selection import PREVIEW_SELECTIONS
from lmcache_backend.blend.timing import NO_TIMER
from lmcache_backend.config import BlendConfig
from lmcache_backend.models.base import ModelAdapter
from lmcache_backend.ops import Ops, get_ops
from lmcache_backend.storage.segments import SegmentStore

#: what LMCache's connector passes to ``LMCBlender.blend`` besides the request: its KV buffers,
#: which this blender does not use (it writes through its ``gpu_connector``)
LMCACHE_BUFFER_ARGS = ("kvcaches", "slot_mapping")


def run_to_end(steps: Generator[Any, None, Any]) -> Any:
    """Exhaust ``steps`` (e.g. :meth:`LMCBlender.blend_layer`) and return its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _tagged(kind: str, steps: Generator[Any, None, Any]) -> Generator[tuple[str, Any], None, Any]:
    """``steps``' items as ``(kind, item)``; returns ``steps``' return value."""
    while True:
        try:
            item = next(steps)
        except StopIteration as done:
            return done.value
        yield kind, item


class LMCBlender:
    """CacheBlend for one model (LMCache's ``lmcache.v1.compute.blend.blender.LMCBlender``).

    Args:
        cache_engine: the segment store.
        gpu_connector: the default :class:`~lmcache_backend.blend.engine_side.KVTarget` of a
            request (an object with only ``write_layer`` is taken as a layer writer); None: the
            blended K/V come back in the result.
        config: the engine's validated settings; a request may bring its own.
        model: the model adapter.
        separator: the segment pattern (see
            :func:`lmcache_backend.blend.segmenting.separator_pattern`), or separator token ids
            matched as they are.
        ops: op set; defaults to ``get_ops(config.backend)``.
        score_reducer: applied to each selection's ``[N]`` token scores before choosing, e.g.
            a sum over tensor-parallel ranks so every rank keeps the same tokens (default: none).
    """

    def __init__(
        self,
        cache_engine: SegmentStore,
        gpu_connector: object | None,
        config: BlendConfig,
        model: ModelAdapter,
        separator: Sequence[int],
        ops: Ops | None = None,
        score_reducer: ScoreReducer | None = None,
    ) -> None:
        config.validate_for_model(model.num_layers)
        self.cache_engine = cache_engine
        self._target = as_target(gpu_connector)
        self.config = config
        self.model = model
        self.compute = BlendCompute(model, ops or get_ops(config.backend), score_reducer)
        self.retriever = SPTBlendRetriever(
            separator, cache_engine, model.fingerprint, device=model.device, dtype=model.dtype
        )
        #: the phase timer of calls that bring none (:mod:`~lmcache_backend.blend.timing`)
        self.timer = NO_TIMER
        #: how a streamed request's hits in host memory reach the device, layer by layer:
        #: ``staged`` or ``direct`` (:mod:`~lmcache_backend.blend.layerwise.layer_load`; benchmarks
        #: compare)
        self.host_load = STAGED

    @property
    def ops(self) -> Ops:
        return self.compute.ops

    @property
    def gpu_connector(self) -> KVTarget:
        """The default target of a request (LMCache's name)."""
        return self._target

    @gpu_connector.setter
    def gpu_connector(self, writer: object | None) -> None:
        self._target = as_target(writer)

    # -- one request ----------------------------------------------------------------------

    def start_request(
        self, tokens: torch.Tensor | Sequence[int], mask: torch.Tensor | None = None, **request
    ) -> BlendMetadata:
        """Look the request's segments up and decide whether to blend; ``request`` takes
        :class:`BlendRequest`'s fields (``cached_prefix``, ``recompute``, ``compute_end``,
        ``strict_end``, ``config``, ``cache_salt``; another name is a ``TypeError``)."""
        return self._plan(BlendRequest.of(tokens, mask=mask, **request), self.timer)

    def _plan(self, request: BlendRequest, timer: Any) -> BlendMetadata:
        config = request.config
        if config is None:
            config = self.config
        elif config is not self.config:
            config.validate_for_model(self.model.num_layers)
        return plan_request(request, config, self.retriever, self.model, timer)

    def process_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        residual: torch.Tensor,
        layer_id: int,
        attn_output: torch.Tensor | None,
        attn_metadata: BlendMetadata,
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, BlendMetadata
    ]:
        """Blend one layer (LMCache's ``process_qkv``; see
        :func:`~lmcache_backend.blend.layerwise.layer_blend.blend_layer_kv`).

        Returns:
            ``(q, keys, values, residual, attn_output, attn_metadata)``: q/residual/attn_output
            reduced to the tokens still active, and the blended ``[T, Hkv, D]`` K/V.
        """
        q, keys, values, residual, attn_output = blend_layer_kv(
            q, k, v, residual, layer_id, attn_output, attn_metadata, self.compute
        )
        return q, keys, values, residual, attn_output, attn_metadata

    @torch.no_grad()
    def run(
        self, request: BlendRequest, target: KVTarget | None = None, timer: Any = None
    ) -> Generator[tuple[str, int], None, BlendResult]:
        """Blend ``request``, yielding ``(kind, layer id)`` after every layer pass: ``kind`` is
        ``"preview"`` for a preview selection's preview layers (they come first) and
        ``"blend"`` for the blend's layers (a preview the target's engine runs is one pass).
        The generator's return value is the :class:`BlendResult`. An engine can run a fixed
        number of passes at a time (the vLLM connector's ``blend_layers_per_step``).

        Args:
            request: the prompt and its settings.
            target: where the blended K/V go (default: the blender's ``gpu_connector``).
            timer: the request's phase timer (default: the blender's ``timer``).
        """
        target = self._target if target is None else target
        timer = self.timer if timer is None else timer
        timer.mark()
        meta = self._plan(request, timer)
        if target.streams_layers and meta.task is not None:
            meta.stream = LayerStream(meta, self.compute, target, self.host_load)
        token_ids = torch.as_tensor(request.token_ids, dtype=torch.int64)
        wants_logits = not meta.strict_end and (meta.compute_end is None or meta.task is None)
        try:
            if meta.config.blend_selection in PREVIEW_SELECTIONS and meta.schedule:
                previewed = preview_selection(meta, token_ids, target, self.compute)
                yield from _tagged("preview", previewed)
            hidden = yield from _tagged(
                "blend",
                run_layers(meta, token_ids, target, self.compute, last_output=wants_logits),
            )
        finally:
            if meta.stream is not None:
                meta.stream.close()
        logits = None
        if wants_logits:
            logits = self.model.logits(hidden[-1:])[0]
            timer.lap("logits")
        return BlendResult(
            logits=logits,
            keys=meta.keys,
            values=meta.values,
            valid_mask=meta.valid_mask.cpu(),
            recomputed=meta.active.cpu(),
            num_reusable=meta.num_reusable,
            token_layers=meta.token_layers,
            fallback_reason=meta.fallback_reason,
            read_share=meta.read_share,
            divergence=meta.divergence,
        )

    def blend_passes(
        self, tokens: torch.Tensor | Sequence[int], mask: torch.Tensor | None = None, **request
    ) -> Generator[tuple[str, int], None, BlendResult]:
        """:meth:`run` of the request ``tokens`` with ``mask`` and ``request``'s
        :class:`BlendRequest` fields."""
        return self.run(BlendRequest.of(tokens, mask=mask, **request))

    def blend_layer(
        self, tokens: torch.Tensor | Sequence[int], mask: torch.Tensor | None = None, **request
    ) -> Generator[int, None, BlendResult]:
        """Run the request layer by layer, yielding each finished blend layer id; the
        generator's return value (``StopIteration.value``) is the :class:`BlendResult`. A preview
        selection's preview layers run inside the first step (see :meth:`blend_passes` to step
        through them too)."""
        passes = self.blend_passes(tokens, mask, **request)
        while True:
            try:
                kind, layer = next(passes)
            except StopIteration as done:
                return done.value
            if kind == "blend":
                yield layer

    def blend(
        self, tokens: torch.Tensor | Sequence[int], mask: torch.Tensor | None = None, **kwargs
    ) -> BlendResult:
        """Run CacheBlend for one request; see the module docstring. ``kwargs`` holds
        :class:`BlendRequest`'s fields (``cache_salt`` included); LMCache's KV buffers
        (:data:`LMCACHE_BUFFER_ARGS`) are accepted and not used; any other name is a
        ``TypeError`` naming it."""
        request = {k: v for k, v in kwargs.items() if k not in LMCACHE_BUFFER_ARGS}
        return run_to_end(self.blend_layer(tokens, mask, **request))


class LMCBlenderBuilder:
    """One :class:`LMCBlender` per engine instance id (LMCache's ``LMCBlenderBuilder``)."""

    _blenders: dict[str, LMCBlender] = {}

    @classmethod
    def get_or_create(
        cls,
        instance_id: str,
        cache_engine: SegmentStore,
        gpu_connector: object | None,
        config: BlendConfig,
        model: ModelAdapter,
        separator: Sequence[int],
        ops: Ops | None = None,
    ) -> LMCBlender:
        """Return the blender of ``instance_id``, creating it on first call."""
        if instance_id not in cls._blenders:
            cls._blenders[instance_id] = LMCBlender(
                cache_engine, gpu_connector, config, model, separator, ops
            )
        return cls._blenders[instance_id]

    @classmethod
    def get(cls, instance_id: str) -> LMCBlender:
        """The blender of ``instance_id``; ``KeyError`` if none was created."""
        return cls._blenders[instance_id]

    @classmethod
    def remove(cls, instance_id: str) -> None:
        cls._blenders.pop(instance_id, None)
