"""``SPTBlendRetriever``: retrieval of cached K/V split on a special-token separator.

Input ``[x, x, x, S, y, y, S, z, z, z, z]`` (``S`` the separator ids) is looked up as the
segments ``[x, x, x, S]`` and ``[y, y, S]``; each hit fills its rows. The query tail
``[z, z, z, z]`` is never looked up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_backend.blend.interfaces import (
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
)
from lmcache_backend.blend.segmenting import Segment, SeparatorPattern
from lmcache_backend.blend.segments.provenance import HitContext, hit_contexts
from lmcache_backend.blend.segments.segment_cache import SegmentCache
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage.segments import SegmentKV, SegmentStore


class SPTBlendRetrieverTask(BlendRetrieverTask):
    """The hits of one :meth:`SPTBlendRetriever.new_request`, materialised per layer on demand.

    Attributes:
        hits: ``(global start, segment KV)`` of each cached segment.
        contexts: each hit's provenance against its place in the prompt, in the order of
            ``hits`` (:class:`~lmcache_backend.blend.segments.provenance.HitContext`).
        num_tokens: ``T``.
        valid_mask: ``[T]`` bool (CPU).
        original_positions: ``[T]`` int64 (on ``device``).
    """

    def __init__(
        self,
        hits: list[tuple[int, SegmentKV]],
        num_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        contexts: list[HitContext] | None = None,
    ) -> None:
        self.hits = hits
        self.contexts = contexts if contexts is not None else []
        self.num_tokens = num_tokens
        self.device = device
        self.dtype = dtype
        valid = torch.zeros(num_tokens, dtype=torch.bool)
        original = torch.zeros(num_tokens, dtype=torch.int64)
        for start, kv in hits:
            n = kv.num_tokens
            valid[start : start + n] = True
            original[start : start + n] = torch.arange(kv.start_position, kv.start_position + n)
        self.valid_mask = valid
        self.original_positions = original.to(device)

    def result(self, layer_id: int) -> BlendRetrieverResult:
        if not self.hits:
            return BlendRetrieverResult(None, None, self.valid_mask, self.original_positions)
        _, first = self.hits[0]
        width = first.keys.shape[2] * first.keys.shape[3]
        k = torch.zeros(self.num_tokens, width, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        for start, kv in self.hits:
            n = kv.num_tokens
            k[start : start + n] = kv.keys[layer_id].reshape(n, width).to(self.device, self.dtype)
            v[start : start + n] = kv.values[layer_id].reshape(n, width).to(self.device, self.dtype)
        return BlendRetrieverResult(k, v, self.valid_mask, self.original_positions)

    def fill_layer(
        self, layer_id: int, keys: torch.Tensor, values: torch.Tensor, non_blocking: bool = False
    ) -> None:
        """Write layer ``layer_id``'s cached K/V into ``keys``/``values`` (``[T, Hkv, D]``, on
        any device): hit rows copied, every other row zero. ``non_blocking``: the copies from
        page-locked host memory may run asynchronously on the current stream."""
        keys.zero_()
        values.zero_()
        for start, kv in self.hits:
            n = kv.num_tokens
            keys[start : start + n].copy_(kv.keys[layer_id], non_blocking=non_blocking)
            values[start : start + n].copy_(kv.values[layer_id], non_blocking=non_blocking)

    def stacked(self, num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer's cached K and V at once, ``[L, T, Hkv*D]`` each (rows of uncached
        tokens are zero), or None without hits.

        One contiguous copy per hit and layer instead of one allocation and copy of the whole
        prompt per layer.
        """
        if not self.hits:
            return None
        _, first = self.hits[0]
        width = first.keys.shape[2] * first.keys.shape[3]
        shape = (num_layers, self.num_tokens, width)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        for start, kv in self.hits:
            n = kv.num_tokens
            k[:, start : start + n] = kv.keys.reshape(num_layers, n, width)
            v[:, start : start + n] = kv.values.reshape(num_layers, n, width)
        # row indices, not a boolean mask: a mask indexes by a full pass over [L, T, Hkv*D]
        gaps = torch.nonzero(~self.valid_mask, as_tuple=False).flatten().to(self.device)
        if gaps.numel():
            k[:, gaps] = 0
            v[:, gaps] = 0
        return k, v


class SPTBlendRetriever(BlendRetriever):
    """Retriever of the segments of a prompt the store holds (never its query tail).

    Args:
        spt: the segment pattern (:class:`~lmcache_backend.blend.segmenting.SeparatorPattern`),
            or separator token ids (``[S]`` tensor or a sequence) matched as they are.
        cache_engine: the segment store.
        metadata: the model's fingerprint (keys entries, and gives the expected layout).
        device, dtype: where and how retrieved K/V are returned.
    """

    def __init__(
        self,
        spt: SeparatorPattern | torch.Tensor | Sequence[int],
        cache_engine: SegmentStore,
        metadata: ModelFingerprint,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.segment_cache = SegmentCache(cache_engine, metadata, spt)
        self.device = torch.device(device)
        self.dtype = dtype

    def new_request(
        self,
        input_tokens: torch.Tensor | Sequence[int],
        query_start_loc: torch.Tensor | None,
        cache_salt: str | None = None,
    ) -> SPTBlendRetrieverTask:
        """Look the segments of ``input_tokens`` up in the namespace of ``cache_salt`` (the
        request's; ``None``: unsalted): a segment stored under another salt is never found."""
        cache = self.segment_cache.salted(cache_salt)
        tokens = (
            input_tokens.tolist() if isinstance(input_tokens, torch.Tensor) else list(input_tokens)
        )
        bounds = [0, len(tokens)] if query_start_loc is None else [int(b) for b in query_start_loc]
        hits: list[tuple[int, SegmentKV]] = []
        contexts: list[HitContext] = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part = tokens[lo:hi]
            found = [(segment.start, kv) for segment, kv in cache.lookup(part) if kv is not None]
            if found:
                units = cache.cacheable_segments(part)
                contexts += hit_contexts(part, found, units, cache.keys(part, units))
            hits += [(lo + start, kv) for start, kv in found]
        # a context's start is within its part of the prompt: make it global
        contexts = [
            HitContext(start, ctx.length, ctx.exact, ctx.distance)
            for (start, _), ctx in zip(hits, contexts)
        ]
        return SPTBlendRetrieverTask(hits, len(tokens), self.device, self.dtype, contexts)

    def segments(self, tokens: Sequence[int]) -> list[Segment]:
        return self.segment_cache.segments(tokens)
