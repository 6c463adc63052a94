"""One blend request: what comes in (:class:`BlendRequest`), the state carried from layer to
layer (:class:`BlendMetadata`) and what comes out (:class:`BlendResult`).

Shapes: ``T`` tokens of the prompt, ``N`` tokens still computed, ``L`` layers, ``Hkv`` key-value
heads, ``D`` head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_backend.blend.segments.retriever import SPTBlendRetrieverTask
from lmcache_backend.blend.timing import NO_TIMER
from lmcache_backend.config import BlendConfig

#: per layer ``[P, Hkv, D]`` keys and values of the prompt's first ``P`` tokens
LayerPrefix = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class BlendRequest:
    """A prompt to blend, with everything particular to it.

    Attributes:
        token_ids: the prompt's ``T`` token ids.
        mask: optional ``[T]`` bool; False excludes a token from reuse.
        cached_prefix: optional per-layer K/V of the first ``P`` tokens computed at their
            current positions (vLLM's prefix-cache hits). They count as reusable and need no
            re-rotation.
        recompute: optional ``[T]`` bool: a fixed set of tokens recomputed in every layer (e.g.
            EPIC's first tokens of each chunk) instead of the selection; uncached tokens and the
            last token are added.
        compute_end: leave tokens ``compute_end..T-1`` to the engine once the selection is fixed
            (``1 <= compute_end <= T``); see :class:`BlendMetadata`.
        strict_end: never compute a token from ``compute_end`` on in a blend layer (the engine
            has no cache slots for them). Only for selections that do not read those tokens in a
            blend layer: a fixed ``recompute``, the preview selections (their preview pass writes
            nothing) or a fallback; a check-layer selection raises ``ValueError``.
        config: this request's settings (its ``kv_transfer_params`` applied to the engine's),
            already validated; None: the blender's own.
        cache_salt: the request's ``cache_salt`` (vLLM's tenant isolation): only segments
            stored under the same salt are reused; ``None``: unsalted segments only.
    """

    token_ids: list[int]
    mask: torch.Tensor | None = None
    cached_prefix: LayerPrefix | None = None
    recompute: torch.Tensor | None = None
    compute_end: int | None = None
    strict_end: bool = False
    config: BlendConfig | None = None
    cache_salt: str | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor | Sequence[int], **fields: Any) -> BlendRequest:
        """A request for ``tokens`` (a tensor or a sequence of ids) with ``fields``.

        Raises:
            TypeError: a name in ``fields`` is not a request field (one line naming it and the
                fields there are).
        """
        unknown = sorted(set(fields) - set(REQUEST_FIELDS))
        if unknown:
            raise TypeError(
                f"unknown blend request field(s) {', '.join(map(repr, unknown))}: a request "
                f"takes {', '.join(REQUEST_FIELDS)}"
            )
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return cls(token_ids=ids, **fields)


#: :class:`BlendRequest` fields a call may pass by name besides the tokens (every entry point of
#: :class:`~lmcache_backend.blend.blender.LMCBlender` takes them all)
REQUEST_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(BlendRequest) if f.name != "token_ids"
)


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
        task: the retrieval, or None when nothing is reused.
        config: the request's settings.
        query_start: index of the first query token: the tokens after the last reusable one
            (the question and the assistant header), always computed.
        exact_prefix: leading tokens whose cached K/V is exactly what a full prefill computes
            (a segment stored at position 0, or the engine's own prefix-cache hit): never worth
            recomputing, so the query-aware selections skip them (they attract much of the
            attention mass as the attention sink).
        query_attention: ``[T]`` fp32 attention mass from the query tokens accumulated over the
            layers up to the last check layer, for the query-aware selections; else None.
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
        timer: the request's phase timer (:mod:`lmcache_backend.blend.timing`).
        stream: with a target that ``streams_layers``, the cached K/V one layer at a time
            (:class:`~lmcache_backend.blend.layerwise.cached_kv.LayerStream`); else None.
        cached_in_target: every layer's cached rows are already in the target (a streamed
            preview wrote them): the blend computes its rows without retrieving again.
        read_share: the share of what the question reads of the reusable tokens (the preview's
            scores) that the recomputed ones hold; None without a preview
            (:mod:`lmcache_backend.blend.selectors.read_share`).
        divergence: the blend's divergence estimate: the staleness-weighted share of the last
            prompt token's attention left on tokens not recomputed; None without a preview
            (:mod:`lmcache_backend.blend.selectors.staleness`).
    """

    positions: torch.Tensor
    active: torch.Tensor
    valid_mask: torch.Tensor
    num_reusable: int
    schedule: dict[int, float]
    task: SPTBlendRetrieverTask | None
    config: BlendConfig
    query_start: int = 0
    exact_prefix: int = 0
    query_attention: torch.Tensor | None = None
    cached_prefix: LayerPrefix | None = None
    cached_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    token_layers: int = 0
    fallback_reason: str | None = None
    compute_end: int | None = None
    strict_end: bool = False
    timer: Any = NO_TIMER
    stream: Any = None
    cached_in_target: bool = False
    read_share: float | None = None
    divergence: float | None = None

    def drop_tail(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (indices into ``active``) without the tokens left to the engine."""
        if self.compute_end is None or self.task is None:
            return rows
        return rows[self.active[rows] < self.compute_end]

    def fix_selection(self, chosen: torch.Tensor) -> None:
        """Switch to the fixed selection ``chosen`` (``[T]`` bool), recomputed in every layer;
        tokens from ``compute_end`` on are left to the engine."""
        if self.compute_end is not None:
            chosen[self.compute_end :] = False
        self.active = torch.nonzero(chosen, as_tuple=False).flatten()
        self.schedule = {}


@dataclass
class BlendResult:
    """What a blended (or fallen-back) prefill produced.

    Attributes:
        logits: ``[vocab]`` fp32 logits of the last token; None when the blend stopped at a
            ``compute_end`` (the engine computes the last token).
        keys, values: per layer ``[T, Hkv, D]`` blended K/V of every token, ready for decoding
            (empty when they went straight into the engine's cache, see
            :class:`~lmcache_backend.blend.engine_side.KVTarget`).
        valid_mask: ``[T]`` bool (CPU): tokens whose cached K/V was reused.
        recomputed: ``[N]`` int64 (CPU): tokens computed in the last layer.
        num_reusable: valid tokens at the start.
        token_layers: sum over layers of tokens computed (``T * L`` for a full prefill).
        fallback_reason: why blending fell back to a full prefill, or None if it blended.
        read_share: the share of the question's reads of the reusable tokens that the
            recomputed tokens hold (preview selections); None otherwise.
        divergence: the blend's divergence estimate (preview selections,
            :mod:`lmcache_backend.blend.selectors.staleness`); None otherwise.
    """

    logits: torch.Tensor | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid_mask: torch.Tensor
    recomputed: torch.Tensor
    num_reusable: int
    token_layers: int
    fallback_reason: str | None
    read_share: float | None = None
    divergence: float | None = None

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
