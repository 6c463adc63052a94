"""``LMCBlender``: CacheBlend over a model adapter and the op registry.

One request, ``T`` tokens at positions ``0..T-1``:

1. split the tokens on the separator and look the segments up (hits give per-layer K/V computed
   at other positions, ``valid_mask`` marks their rows);
2. layer by layer, compute fresh q/k/v for the *active* tokens (all tokens until the first check
   layer); re-rotate the cached keys from their old positions to the new ones;
3. at a check layer, keep the ``ratio * num_reusable`` valid tokens whose fresh key deviates most
   from the cached one, plus every uncached token and the last token; only those stay active;
4. the blended K/V are the cached rows with the active tokens' fresh rows scattered in; each
   active query at position ``p`` attends keys ``0..p`` of them (exact causal mask);
5. o_proj and MLP run for the active tokens only; the last token's logits come out at the end.

An engine that computes the prompt's tail itself (the vLLM connector leaves it the question)
passes ``compute_end``: once the selection is fixed, only active tokens before it are computed,
and the blend produces the K/V of tokens ``0..compute_end-1`` and no logits.

With fewer reusable tokens than ``blend_min_tokens`` (or a prompt longer than the model's exact
attention span) the same loop runs with every token active: a full prefill, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lmcache_backend.blend.retriever import SPTBlendRetriever, SPTBlendRetrieverTask
from lmcache_backend.blend.selection import (
    NEEDS_QUERY_ATTENTION,
    PREVIEW_SELECTIONS,
    QUERY_PREVIEW_LAST,
    SCORERS,
    CheckInputs,
    attention_with_query_mass,
    position_discount,
    query_and_last_scores,
    query_attention_mass,
    span_ranked,
    value_norms,
)
from lmcache_backend.blend.timing import NO_TIMER
from lmcache_backend.config import BlendConfig
from lmcache_backend.models.base import ModelAdapter
from lmcache_backend.ops import Ops, get_ops
from lmcache_backend.ops.reference import select_topk_with_invalid, selection_count
from lmcache_backend.storage.segments import SegmentStore

logger = logging.getLogger(__name__)

# Score of exact-prefix tokens for the query-aware selections: below every other reusable token,
# above the uncached ones (-inf inside the top-k), so a ratio of 1.0 still recomputes them all.
_LAST_RESORT = -torch.finfo(torch.float32).max


#: profile names of each layer kind's phases (``blend_layer``)
_PHASE_NAMES = {
    p: (f"{p}: rest", f"{p}: attention") for p in ("full", "check", "selected", "preview")
}


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


class KVLayerWriter(Protocol):
    """Receives each layer's blended K/V as soon as it is final (e.g. into a paged cache)."""

    def write_layer(self, layer_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``keys``, ``values``: ``[T, Hkv, D]`` for every token of the request."""


class PagedKV(KVLayerWriter, Protocol):
    """A writer that also serves attention over what it wrote (an engine's paged cache).

    When ``paged_attention`` is true for the request, the blender writes each layer's rows as
    soon as they are known (all cached rows of every layer once, then the computed rows of each
    layer) and calls :meth:`attention` instead of the op registry's ``attention_at_positions``:
    no per-layer copy of the whole prompt's K/V is attended over or written back.
    """

    paged_attention: bool

    def write_rows(
        self, layer_id: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """``keys``, ``values``: ``[N, Hkv, D]`` of the token indices ``rows [N]``."""

    def attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at sorted ``positions [N]`` over the written keys ``0..p`` of each
        query -> ``[N, Hq, D]``. ``keys``/``values`` ``[T, Hkv, D]``: the same rows as the
        layer's written ones, contiguous (a writer may attend over them instead)."""


class EngineForwardKV(PagedKV, Protocol):
    """A paged writer whose engine can compute rows itself: its own forward pass of the given
    tokens over the paged cache, writing their rows of every layer. A fixed selection without
    logits needs nothing more once every cached row is written (see ``_run_layers``)."""

    runs_engine_forward: bool

    def forward_rows(
        self,
        rows: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Tokens ``rows [N]`` (``token_ids [N]`` at sorted ``positions [N]``) in every layer;
        ``kv``: the request's blended K/V, ``[L, T, Hkv, D]`` each, as the cache holds them."""


#: ``attend(layer_id, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D]``
PreviewAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class EnginePreview(Protocol):
    """A writer whose engine can run a preview selection's tokens through its own layers, with
    each layer's attention left to the blender (which attends over its cached K/V and sums the
    attention mass the selection needs). Nothing is written."""

    def preview_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: PreviewAttend
    ) -> bool:
        """Tokens ``token_ids [N]`` at sorted ``positions [N]`` through every layer, layer
        ``l``'s attention being ``attend(l, q, k, v)`` of their fresh q/k/v. False when it did
        not run (the blender then runs the preview layer by layer)."""


@dataclass
class BlendMetadata:
    """Per-request state carried from layer to layer (``attn_metadata`` of ``process_qkv``).

    Attributes:
        positions: ``[T]`` int64 positions of the prompt's tokens.
        active: ``[N]`` int64 sorted indices of the tokens still computed; the last token is
            always among them.
        valid_mask: ``[T]`` bool: the token's cached K/V is reused.
        num_reusable: number of valid tokens; every check layer's ratio applies to it.
        schedule: check layer -> ratio.
        query_start: index of the first query token: the tokens after the last reusable one
            (the question and the assistant header), always computed.
        exact_prefix: leading tokens whose cached K/V is exactly what a full prefill computes
            (a segment stored at position 0, or the engine's own prefix-cache hit): never worth
            recomputing, so the query-aware selections skip them (they attract much of the
            attention mass as the attention sink).
        query_attention: ``[T]`` fp32 attention mass from the query tokens accumulated over the
            layers up to the last check layer, for the query-aware selections; else None.
        task: the retrieval, or None when nothing is reused.
        cached_prefix: per-layer ``[P, Hkv, D]`` K and V of tokens ``0..P-1`` that were
            computed at their current positions (e.g. already in the engine's paged cache).
        cached_kv: ``[L, T, Hkv, D]`` K and V of every layer (retrieved, prefix filled in,
            keys re-rotated), once the first layer needs them.
        keys, values: blended ``[T, Hkv, D]`` per finished layer.
        token_layers: sum over layers of the number of tokens computed.
        fallback_reason: why the request runs as a full prefill, or None when it blends.
        compute_end: tokens from this index on are the engine's to compute: dropped from
            ``active`` once the selection is fixed (after the last check layer, or at once for a
            fixed selection); None computes the whole prompt.
        strict_end: no token from ``compute_end`` on is ever computed by a blend layer, not even
            in a fallback (the engine holds no cache slots for them): a fallback runs as the
            full prefill of tokens ``0..compute_end-1`` alone.
    """

    positions: torch.Tensor
    active: torch.Tensor
    valid_mask: torch.Tensor
    num_reusable: int
    schedule: dict[int, float]
    task: SPTBlendRetrieverTask | None
    query_start: int = 0
    exact_prefix: int = 0
    query_attention: torch.Tensor | None = None
    cached_prefix: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None
    cached_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    token_layers: int = 0
    fallback_reason: str | None = None
    compute_end: int | None = None
    strict_end: bool = False

    def drop_tail(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (indices into ``active``) without the tokens left to the engine."""
        if self.compute_end is None or self.task is None:
            return rows
        return rows[self.active[rows] < self.compute_end]


@dataclass
class BlendResult:
    """What a blended (or fallen-back) prefill produced.

    Attributes:
        logits: ``[vocab]`` fp32 logits of the last token; None when the blend stopped at a
            ``compute_end`` (the engine computes the last token).
        keys, values: per layer ``[T, Hkv, D]`` blended K/V of every token, ready for decoding.
        valid_mask: ``[T]`` bool (CPU): tokens whose cached K/V was reused.
        recomputed: ``[N]`` int64 (CPU): tokens computed in the last layer.
        num_reusable: valid tokens at the start.
        token_layers: sum over layers of tokens computed (``T * L`` for a full prefill).
        fallback_reason: why blending fell back to a full prefill, or None if it blended.
    """

    logits: torch.Tensor | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid_mask: torch.Tensor
    recomputed: torch.Tensor
    num_reusable: int
    token_layers: int
    fallback_reason: str | None

    @property
    def blended(self) -> bool:
        return self.fallback_reason is None

    @property
    def num_tokens(self) -> int:
        return int(self.valid_mask.numel())

    @property
    def recomputed_reusable(self) -> int:
        """Reusable tokens recomputed in the last layer (excludes uncached tokens)."""
        return int(self.valid_mask[self.recomputed].sum())


class LMCBlender:
    """CacheBlend for one model (LMCache's ``lmcache.v1.compute.blend.blender.LMCBlender``).

    Args:
        cache_engine: the segment store.
        gpu_connector: optional :class:`KVLayerWriter` receiving each layer's blended K/V.
        config: validated settings (check layers, ratios, ``blend_min_tokens``, backend).
        model: the model adapter.
        separator: the segment pattern (see
            :func:`lmcache_backend.blend.segmenting.separator_pattern`), or separator token ids
            matched as they are.
        ops: op set; defaults to ``get_ops(config.backend)``.
        score_reducer: applied to each check layer's ``[N]`` token scores before choosing, e.g.
            a sum over tensor-parallel ranks so every rank keeps the same tokens (default: none).
    """

    def __init__(
        self,
        cache_engine: SegmentStore,
        gpu_connector: KVLayerWriter | None,
        config: BlendConfig,
        model: ModelAdapter,
        separator: Sequence[int],
        ops: Ops | None = None,
        score_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        config.validate_for_model(model.num_layers)
        self.score_reducer = score_reducer
        self.cache_engine = cache_engine
        self.gpu_connector = gpu_connector
        self.config = config
        self.model = model
        self.ops = ops or get_ops(config.backend)
        self.retriever = SPTBlendRetriever(
            separator, cache_engine, model.fingerprint, device=model.device, dtype=model.dtype
        )
        #: phase timer (:class:`~lmcache_backend.blend.timing.PhaseTimer`); off by default
        self.timer = NO_TIMER

    # -- request set-up -------------------------------------------------------------------

    def start_request(
        self,
        tokens: torch.Tensor | Sequence[int],
        mask: torch.Tensor | None = None,
        *,
        cached_prefix: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
        recompute: torch.Tensor | None = None,
        compute_end: int | None = None,
        strict_end: bool = False,
    ) -> BlendMetadata:
        """Look the request's segments up and decide whether to blend.

        Args:
            tokens: ``[T]`` token ids.
            mask: optional ``[T]`` bool; False excludes a token from reuse.
            cached_prefix: optional ``(keys, values)``, per layer ``[P, Hkv, D]``: K/V of the
                first ``P`` tokens computed at their current positions (vLLM's prefix-cache
                hits). They count as reusable and need no re-rotation.
            recompute: optional ``[T]`` bool: a fixed set of tokens recomputed in every layer
                (e.g. EPIC's first tokens of each chunk) instead of the check-layer selection;
                uncached tokens and the last token are added.
            compute_end: leave tokens ``compute_end..T-1`` to the engine once the selection is
                fixed (``1 <= compute_end <= T``); see :class:`BlendMetadata`.
            strict_end: never compute a token from ``compute_end`` on in a blend layer (the
                engine has no cache slots for them). Only for selections that do not read those
                tokens in a blend layer: a fixed ``recompute``, the preview selections (their
                preview pass writes nothing) or a fallback; a check-layer selection raises
                ``ValueError``.
        """
        token_list = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        num_tokens = len(token_list)
        if num_tokens == 0:
            raise ValueError("LMCBlender: the prompt holds no tokens")
        device = self.model.device
        task = self.retriever.new_request(token_list, None)
        self.timer.lap("lookup")
        valid = task.valid_mask.clone()
        if cached_prefix is not None:
            prefix_len = cached_prefix[0][0].shape[0] if len(cached_prefix[0]) else 0
            if len(cached_prefix[0]) != self.model.num_layers or prefix_len > num_tokens:
                raise ValueError(
                    f"cached_prefix must hold {self.model.num_layers} layers of at most "
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
        span = self.model.max_exact_tokens
        if span is not None and num_tokens > span:
            reason = f"{num_tokens} tokens exceed the model's sliding window of {span}"
        elif num_reusable < self.config.blend_min_tokens:
            reason = (
                f"{num_reusable} reusable tokens < blend_min_tokens={self.config.blend_min_tokens}"
            )
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
        schedule = dict(self.config.check_schedule()) if num_reusable else {}
        if (
            strict_end
            and schedule
            and recompute is None
            and self.config.blend_selection not in PREVIEW_SELECTIONS
        ):
            raise ValueError(
                f"strict_end: blend_selection={self.config.blend_selection!r} computes the "
                "tokens after compute_end at its check layers"
            )
        if recompute is not None and num_reusable:
            chosen = recompute.to("cpu", torch.bool) | ~valid
            chosen[-1] = True
            active = torch.nonzero(chosen, as_tuple=False).flatten()
            schedule = {}
        reusable_at = torch.nonzero(valid, as_tuple=False).flatten()
        query_start = int(reusable_at[-1]) + 1 if reusable_at.numel() else 0
        exact_prefix = self._exact_prefix(task, cached_prefix)
        meta = BlendMetadata(
            positions=torch.arange(num_tokens, device=device),
            active=active.to(device),
            valid_mask=valid.to(device),
            num_reusable=num_reusable,
            schedule=schedule,
            query_start=query_start,
            exact_prefix=exact_prefix if num_reusable else 0,
            task=task if num_reusable else None,
            cached_prefix=cached_prefix if num_reusable else None,
            fallback_reason=reason,
            compute_end=compute_end,
            strict_end=strict_end,
        )
        if recompute is not None:  # a fixed selection: the tail is the engine's from layer 0
            meta.active = meta.active[meta.drop_tail(torch.arange(meta.active.numel()))]
        return meta

    @staticmethod
    def _exact_prefix(
        task: SPTBlendRetrieverTask,
        cached_prefix: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None,
    ) -> int:
        """Leading tokens whose cached K/V needs no recomputation: the engine's prefix-cache hit,
        or a first segment stored at position 0 (nothing precedes it in either prompt)."""
        exact = (
            cached_prefix[0][0].shape[0] if cached_prefix is not None and cached_prefix[0] else 0
        )
        for start, kv in task.hits:
            if start == 0 and kv.start_position == 0:
                exact = max(exact, kv.num_tokens)
        return exact

    # -- one layer ------------------------------------------------------------------------

    def _cached_layers(self, meta: BlendMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's retrieved K/V, ``[L, T, Hkv, D]`` each, keys re-rotated to the new
        positions; built once per request (on first use) and kept in ``meta.cached_kv``."""
        if meta.cached_kv is not None:
            return meta.cached_kv
        model, num_tokens, layers = self.model, meta.positions.numel(), self.model.num_layers
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
        self.timer.lap("load")
        moved = meta.valid_mask & (original != meta.positions)
        adapter_op = getattr(model, "rope_rerotate_k", None)  # the engine's own kernel
        if adapter_op is not None and self.ops.name == "torch":
            if bool(moved.any()):
                # every row of every layer at once; a row that did not move turns by angle 0
                old = torch.where(moved, original, meta.positions)
                adapter_op(
                    keys.view(layers * num_tokens, heads, dim),
                    old.repeat(layers),
                    meta.positions.repeat(layers),
                )
        else:
            rows = torch.nonzero(moved, as_tuple=False).flatten()
            if rows.numel():
                # one call for all layers: a token's angle does not depend on the layer, so the
                # layers are extra heads of a [M, L * Hkv, D] view
                picked = keys[:, rows].transpose(0, 1).contiguous()
                self.ops.rope_rerotate_k(
                    picked.view(rows.numel(), layers * heads, dim),
                    original[rows],
                    meta.positions[rows],
                    model.cos_sin_cache,
                    model.is_neox,
                )
                keys[:, rows] = picked.transpose(0, 1)
        self.timer.lap("rerotate")
        meta.cached_kv = (keys, values)
        return meta.cached_kv

    def _cached_layer(
        self, layer_id: int, meta: BlendMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Retrieved ``[T, Hkv, D]`` K/V of ``layer_id``, keys re-rotated to the new positions:
        views into the request's :meth:`_cached_layers` (the blend scatters into them)."""
        keys, values = self._cached_layers(meta)
        return keys[layer_id], values[layer_id]

    def _accumulate_query_attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        keys: torch.Tensor,
        meta: BlendMetadata,
    ) -> None:
        """Add this layer's attention mass from the query tokens to ``meta.query_attention``.

        Runs up to the last check layer only. Before the first check layer every token is fresh
        (``k`` holds them all); at a later check layer the keys are the cached rows with the
        active tokens' fresh rows in.
        """
        if layer_id > max(meta.schedule):
            return
        num_tokens = meta.positions.numel()
        query_rows = torch.nonzero(meta.active >= meta.query_start, as_tuple=False).flatten()
        if query_rows.numel() == 0:
            return
        if meta.active.numel() == num_tokens:
            current = k
        else:
            current = keys.clone()
            self.ops.scatter_rows(current, meta.active, k)
        mass = query_attention_mass(
            self.ops.gather_rows(q, query_rows),
            current,
            meta.positions[meta.active[query_rows]],
            self.model.attn_scale,
        )
        meta.query_attention = mass if meta.query_attention is None else meta.query_attention + mass

    def _select(
        self,
        layer_id: int,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        meta: BlendMetadata,
    ) -> torch.Tensor:
        """Rows of the active tokens a check layer keeps (sorted ``[M]`` int64), before the last
        token is added."""
        ratio, selection = meta.schedule[layer_id], self.config.blend_selection
        cached_k = self.ops.gather_rows(keys, meta.active)
        valid = meta.valid_mask[meta.active]
        if selection == "kv_deviation":  # LMCache's selection, on the backend's fused op
            return self.ops.kv_deviation_topk(k, cached_k, valid, ratio, meta.num_reusable)
        inputs = CheckInputs(
            k_fresh=k,
            v_fresh=v,
            k_cached=cached_k,
            v_cached=self.ops.gather_rows(values, meta.active),
            valid=valid,
            query_attention=None
            if meta.query_attention is None
            else meta.query_attention[meta.active],
        )
        scores = SCORERS[selection](inputs)
        if self.score_reducer is not None:
            scores = self.score_reducer(scores)
        scores = scores.masked_fill(meta.active < meta.exact_prefix, _LAST_RESORT)
        count = selection_count(ratio, int(valid.sum()), meta.num_reusable)
        return select_topk_with_invalid(scores, valid, count)

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
        """Blend one layer.

        Args:
            q: ``[N, Hq, D]``, k, v: ``[N, Hkv, D]`` fresh (post-RoPE) for the active tokens.
            residual: ``[N, hidden]`` hidden states of the active tokens before this layer.
            layer_id: the layer.
            attn_output: optional ``[N, ...]`` buffer, reduced like ``q`` at a check layer.
            attn_metadata: the request's :class:`BlendMetadata` (updated in place).

        Returns:
            ``(q, keys, values, residual, attn_output, attn_metadata)``: q/residual/attn_output
            reduced to the tokens still active, and the blended ``[T, Hkv, D]`` K/V.
        """
        meta = attn_metadata
        num_tokens = meta.positions.numel()
        all_active = meta.active.numel() == num_tokens
        is_check = layer_id in meta.schedule
        if meta.task is not None and (is_check or not all_active):
            keys, values = self._cached_layer(layer_id, meta)
        elif all_active:
            # Every row is about to be replaced by a fresh one: nothing to retrieve.
            keys, values = k, v
        else:  # pragma: no cover - a subset is active only after a check layer with a task
            raise AssertionError("active subset without cached K/V")
        if self.config.blend_selection in NEEDS_QUERY_ATTENTION and meta.schedule:
            self._accumulate_query_attention(layer_id, q, k, keys, meta)
        if is_check:
            keep = self._select(layer_id, k, v, keys, values, meta)
            last = meta.active.numel() - 1
            if keep.numel() == 0 or int(keep[-1]) != last:  # the last token always stays
                keep = torch.cat([keep, torch.tensor([last], device=keep.device)])
            if layer_id == max(meta.schedule):  # the selection is final
                keep = meta.drop_tail(keep)
            meta.active = meta.active[keep]
            q, k, v, residual = (self.ops.gather_rows(t, keep) for t in (q, k, v, residual))
            if attn_output is not None:
                attn_output = self.ops.gather_rows(attn_output, keep)
        if keys is not k:
            self.ops.scatter_rows(keys, meta.active, k)
            self.ops.scatter_rows(values, meta.active, v)
        meta.keys.append(keys)
        meta.values.append(values)
        meta.token_layers += meta.active.numel()
        return q, keys, values, residual, attn_output, meta

    # -- whole request --------------------------------------------------------------------

    def _run_layers(
        self,
        meta: BlendMetadata,
        token_ids: torch.Tensor,
        writer: KVLayerWriter | None,
        query_mass: torch.Tensor | None = None,
        last_mass: torch.Tensor | None = None,
        last_output: bool = True,
    ) -> Generator[int, None, torch.Tensor | None]:
        """Every layer for ``meta``'s active tokens, yielding each finished layer id; returns the
        last layer's hidden states ``[N, hidden]`` (None when no token was active, or when
        ``last_output`` is False: then the last layer computes only what its K/V and
        ``query_mass`` need, not the attention output, o_proj and MLP nothing would read).
        ``query_mass`` (``[T]`` fp32), when given, receives the value-weighted attention mass from
        the query tokens at every layer, and ``last_mass`` (with ``query_mass`` only) the same
        from the last token alone.

        With a :class:`PagedKV` writer whose ``paged_attention`` is on, each layer's rows go into
        the engine's paged cache and attention runs there; otherwise attention runs on the op
        registry's ``attention_at_positions`` and the writer receives each finished layer."""
        model, timer = self.model, self.timer
        if (
            not last_output
            and query_mass is None
            and not meta.schedule
            and meta.task is not None
            and meta.active.numel()
            and getattr(writer, "runs_engine_forward", False)
        ):
            yield from self._engine_forward(meta, token_ids, writer)
            return None
        # all tokens unless a fixed selection (which may leave nothing before compute_end)
        hidden = model.embed(token_ids[meta.active.cpu()]) if meta.active.numel() else None
        first_check = min(meta.schedule, default=model.num_layers)
        paged = bool(getattr(writer, "paged_attention", False))
        cached_written = False
        for layer in range(model.num_layers):
            if meta.active.numel() == 0:
                # nothing left to compute before compute_end: the layers hold the cached rows
                keys, values = self._cached_layer(layer, meta)
                meta.keys.append(keys)
                meta.values.append(values)
                if paged and not cached_written:
                    self._write_cached_rows(writer, layer, meta)
                    cached_written = True
                elif writer is not None and not paged:
                    writer.write_layer(layer, keys, values)
                timer.lap("write-back")
                yield layer
                continue
            phase = (
                "preview"
                if query_mass is not None
                else "check"
                if layer in meta.schedule
                else "selected"
                if layer > first_check or meta.active.numel() < meta.positions.numel()
                else "full"
            )
            rest, attention = _PHASE_NAMES[phase]
            x = model.attention_input(layer, hidden)
            q, k, v = model.qkv(layer, x, meta.positions[meta.active])
            timer.lap(rest)
            q, keys, values, hidden, _, meta = self.process_qkv(q, k, v, hidden, layer, None, meta)
            timer.lap("select and blend")
            positions = meta.positions[meta.active]
            if paged:
                if meta.cached_kv is not None and not cached_written:
                    self._write_cached_rows(writer, layer, meta)
                    cached_written = True
                elif layer in meta.schedule:  # a later check layer: the kept rows
                    rows = meta.active
                    writer.write_rows(
                        layer,
                        rows,
                        self.ops.gather_rows(keys, rows),
                        self.ops.gather_rows(values, rows),
                    )
                else:  # the computed rows
                    writer.write_rows(layer, meta.active, k, v)
                timer.lap("write-back")
            output = last_output or layer < model.num_layers - 1
            if meta.active.numel() == 0:  # the check layer kept nothing before compute_end
                hidden = None
            elif not output and query_mass is None:  # its K/V are written; nothing reads more
                hidden = None
            else:
                if query_mass is not None:  # the preview: attention and the query's mass at once
                    attn = self._preview_attention(q, keys, values, meta, query_mass, last_mass)
                elif paged:
                    attn = writer.attention(layer, q, positions, model.attn_scale, keys, values)
                else:
                    attn = self.ops.attention_at_positions(
                        q, keys, values, positions, model.attn_scale
                    )
                timer.lap(attention)
                if output:
                    hidden = hidden + model.attention_output(layer, attn)
                    hidden = model.mlp_block(layer, hidden)
                    timer.lap(rest)
                else:  # the preview's last layer: only its attention mass is used
                    hidden = None
            if writer is not None and not paged:
                writer.write_layer(layer, keys, values)
                timer.lap("write-back")
            yield layer
        return hidden

    def _engine_forward(
        self, meta: BlendMetadata, token_ids: torch.Tensor, writer: EngineForwardKV
    ) -> Generator[int, None, None]:
        """A fixed selection without logits through the engine's own forward pass: every cached
        row of every layer into the paged cache, then the selected tokens computed there in one
        pass (they overwrite their rows layer by layer, as the layer-by-layer path does). The
        blended K/V stay in the engine's cache: ``meta.keys``/``values`` stay empty."""
        self._write_cached_rows(writer, 0, meta)
        self.timer.lap("write-back")
        active = meta.active.cpu()
        # the blended K/V of every layer, as the paged cache now holds them: a tiled kernel
        # attends over these (the pass writes each layer's selected rows into both)
        kv = self._cached_layers(meta)
        writer.forward_rows(active, token_ids[active], meta.positions[meta.active], kv)
        meta.token_layers += active.numel() * self.model.num_layers
        self.timer.lap("selected: engine forward")
        yield from range(self.model.num_layers)

    def _preview_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        meta: BlendMetadata,
        query_mass: torch.Tensor,
        last_mass: torch.Tensor | None,
    ) -> torch.Tensor:
        """One preview layer's attention ``[N, Hq, D]`` of the active tokens' ``q [N, Hq, D]``
        over the layer's blended ``keys``/``values`` ``[T, Hkv, D]``; adds the mass the query
        tokens (and the last token alone) give each key, weighted by its value norm, to
        ``query_mass`` (``last_mass``), ``[T]`` fp32."""
        rows = torch.nonzero(meta.active >= meta.query_start, as_tuple=False).flatten()
        positions = meta.positions[meta.active]
        attn, mass, last = attention_with_query_mass(
            q, keys, values, positions, self.model.attn_scale, rows
        )
        norms = value_norms(values)
        query_mass.addcmul_(mass, norms)
        if last_mass is not None:
            last_mass.addcmul_(last, norms)
        return attn

    def _engine_preview(
        self,
        preview: BlendMetadata,
        token_ids: torch.Tensor,
        writer: Any,
        query_mass: torch.Tensor,
        last_mass: torch.Tensor | None,
    ) -> bool:
        """The preview's layers through the engine's own forward pass (its compiled layer glue
        and products), each layer's attention and mass here, as :meth:`_run_layers` computes
        them; False when the writer's engine cannot run it."""
        run = getattr(writer, "preview_rows", None)
        if run is None:
            return False
        timer = self.timer

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            timer.lap("preview: engine forward")
            q, keys, values, _, _, _ = self.process_qkv(q, k, v, None, layer, None, preview)
            timer.lap("select and blend")
            attn = self._preview_attention(q, keys, values, preview, query_mass, last_mass)
            timer.lap("preview: attention")
            return attn

        active = preview.active.cpu()
        ran = bool(run(token_ids[active], preview.positions[preview.active], attend))
        if ran:
            timer.lap("preview: engine forward")
        return ran

    def _write_cached_rows(self, writer: PagedKV, first: int, meta: BlendMetadata) -> None:
        """Every cached row of layers ``first..L-1`` into ``writer``, once per request (the
        computed rows of each layer overwrite theirs as they come)."""
        every = torch.arange(meta.positions.numel(), device=meta.positions.device)
        for layer in range(first, self.model.num_layers):
            cached_k, cached_v = self._cached_layer(layer, meta)
            writer.write_rows(layer, every, cached_k, cached_v)

    def _preview_selection(
        self, meta: BlendMetadata, token_ids: torch.Tensor, writer: Any = None
    ) -> Generator[int, None, None]:
        """``query_preview``: choose the recomputed tokens before the blend, yielding each
        finished preview layer id (nothing when there is nothing to choose; only the last one
        when ``writer``'s engine ran the preview, see :class:`EnginePreview`).

        The query tokens (and any uncached ones) run alone through every layer over the cached
        K/V, as naive reuse computes them; the reusable tokens that contribute most to their
        attention outputs (attention mass times value norm, summed over layers) are recomputed
        in every layer of the blend that follows. ``meta`` is
        switched to that fixed selection in place and keeps the preview's re-rotated cached K/V
        (``cached_kv``: the blend would retrieve the same rows again; the rows the preview
        computed are active again and overwritten) and its token-layers.
        """
        valid = meta.valid_mask
        ratio = list(meta.schedule.values())[-1]
        count = selection_count(ratio, int(valid.sum()), meta.num_reusable)
        chosen = ~valid
        chosen[-1] = True
        if count == 0:  # naive reuse: nothing to choose, no preview
            self._fix_selection(meta, chosen)
            return
        preview = BlendMetadata(
            positions=meta.positions,
            active=torch.nonzero(chosen, as_tuple=False).flatten(),
            valid_mask=valid,
            num_reusable=meta.num_reusable,
            schedule={},
            task=meta.task,
            query_start=meta.query_start,
            cached_prefix=meta.cached_prefix,
        )
        mass = torch.zeros(meta.positions.numel(), dtype=torch.float32, device=valid.device)
        last = torch.zeros_like(mass) if self.config.blend_selection == QUERY_PREVIEW_LAST else None
        if self._engine_preview(preview, token_ids, writer, mass, last):
            yield self.model.num_layers - 1
        else:
            yield from self._run_layers(preview, token_ids, None, mass, last, last_output=False)
        if self.score_reducer is not None:
            mass = self.score_reducer(mass)
            last = None if last is None else self.score_reducer(last)
        candidates = valid.clone()  # the tokens the selection may choose
        candidates[: meta.exact_prefix] = False
        if last is not None:
            mass = query_and_last_scores(mass, last, candidates)
        if self.config.blend_position_discount > 0:
            discount = self.config.blend_position_discount
            mass = mass / position_discount(meta.positions.to(mass.device), discount)
        if self.config.blend_selection_span > 1:
            mass = span_ranked(mass, candidates, self.config.blend_selection_span)
        mass[: meta.exact_prefix] = _LAST_RESORT
        chosen[select_topk_with_invalid(mass, valid, count)] = True
        meta.cached_kv = preview.cached_kv
        meta.token_layers = preview.token_layers
        self._fix_selection(meta, chosen)

    @staticmethod
    def _fix_selection(meta: BlendMetadata, chosen: torch.Tensor) -> None:
        """Switch ``meta`` to the fixed selection ``chosen`` (``[T]`` bool), recomputed in every
        layer; tokens from ``compute_end`` on are left to the engine."""
        if meta.compute_end is not None:
            chosen[meta.compute_end :] = False
        meta.active = torch.nonzero(chosen, as_tuple=False).flatten()
        meta.schedule = {}

    @torch.no_grad()
    def blend_layer(
        self,
        tokens: torch.Tensor | Sequence[int],
        mask: torch.Tensor | None = None,
        **request: Any,
    ) -> Generator[int, None, BlendResult]:
        """Run the request layer by layer, yielding each finished layer id; the generator's
        return value (``StopIteration.value``) is the :class:`BlendResult`. ``request`` takes
        :meth:`start_request`'s keyword arguments (``cached_prefix``, ``recompute``,
        ``compute_end``, ``strict_end``). A preview selection's preview layers run inside the
        first step (see :meth:`blend_passes` to step through them too)."""
        passes = self.blend_passes(tokens, mask, **request)
        while True:
            try:
                kind, layer = next(passes)
            except StopIteration as done:
                return done.value
            if kind == "blend":
                yield layer

    @torch.no_grad()
    def blend_passes(
        self,
        tokens: torch.Tensor | Sequence[int],
        mask: torch.Tensor | None = None,
        **request: Any,
    ) -> Generator[tuple[str, int], None, BlendResult]:
        """:meth:`blend_layer`, yielding ``(kind, layer id)`` after every layer pass: ``kind`` is
        ``"preview"`` for a preview selection's preview layers (they come first) and
        ``"blend"`` for the blend's layers (a preview the writer's engine runs, see
        :class:`EnginePreview`, is one pass). An engine can run a fixed number of passes at a
        time (the vLLM connector's ``blend_layers_per_step``)."""
        self.timer.mark()
        meta = self.start_request(tokens, mask, **request)
        token_ids = torch.as_tensor(tokens, dtype=torch.int64)
        writer = self.gpu_connector  # the request's writer, whatever it is when it resumes
        if self.config.blend_selection in PREVIEW_SELECTIONS and meta.schedule:
            yield from _tagged("preview", self._preview_selection(meta, token_ids, writer))
        wants_logits = not meta.strict_end and (meta.compute_end is None or meta.task is None)
        hidden = yield from _tagged(
            "blend", self._run_layers(meta, token_ids, writer, last_output=wants_logits)
        )
        logits = None
        if wants_logits:
            logits = self.model.logits(hidden[-1:])[0]
            self.timer.lap("logits")
        return BlendResult(
            logits=logits,
            keys=meta.keys,
            values=meta.values,
            valid_mask=meta.valid_mask.cpu(),
            recomputed=meta.active.cpu(),
            num_reusable=meta.num_reusable,
            token_layers=meta.token_layers,
            fallback_reason=meta.fallback_reason,
        )

    def blend(
        self,
        tokens: torch.Tensor | Sequence[int],
        mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BlendResult:
        """Run CacheBlend for one request; see the module docstring. ``kwargs`` may hold
        :meth:`start_request`'s ``cached_prefix``, ``recompute``, ``compute_end`` and
        ``strict_end``; other keys
        (LMCache passes KV buffers this way) are ignored."""
        keys = ("cached_prefix", "recompute", "compute_end", "strict_end")
        request = {k: kwargs[k] for k in keys if k in kwargs}
        return run_to_end(self.blend_layer(tokens, mask, **request))


class LMCBlenderBuilder:
    """One :class:`LMCBlender` per engine instance id (LMCache's ``LMCBlenderBuilder``)."""

    _blenders: dict[str, LMCBlender] = {}

    @classmethod
    def get_or_create(
        cls,
        instance_id: str,
        cache_engine: SegmentStore,
        gpu_connector: KVLayerWriter | None,
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
