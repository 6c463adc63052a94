"""Prompt segments <-> the segment store, for one model.

Looks segments up (validating each entry's layout against the model before use) and stores the
K/V of a prompt's segments after it was computed.

Only segments before the query tail are cached: with a separator, the segments that end with it
(the system part and the chunks). The tail after the last separator is the query: the question
and the assistant header. It is new in every real RAG request, so it is never served from the
store (even when an earlier prompt held the same question, its K/V were computed against another
context) and never stored.

A cache is bound to one key namespace: unsalted, or one request's ``cache_salt``
(:meth:`SegmentCache.salted`); keys of two namespaces never coincide, so requests of different
salts never see each other's segments.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmcache_backend.blend.segmenting import Segment
from lmcache_backend.blend.segments.patterns import SegmentPattern, as_pattern
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage.segments import (
    SegmentKV,
    SegmentStore,
    context_digest,
    segment_key,
    segment_keys,
    unit_tag,
)

logger = logging.getLogger(__name__)


class SegmentCache:
    """Segment lookups and stores for one model and one segment pattern.

    Args:
        store: the segment store.
        fingerprint: the model's fingerprint (part of every key).
        separator: the segment pattern (:func:`~lmcache_backend.blend.segmenting.segment_pattern`:
            a separator, or separator-free blocks), or plain separator token ids matched as
            they are.
        salt: the key namespace (a request's ``cache_salt``); ``None`` or ``""``: unsalted.
    """

    def __init__(
        self,
        store: SegmentStore,
        fingerprint: ModelFingerprint,
        separator: SegmentPattern | Sequence[int],
        salt: str | None = None,
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.pattern = as_pattern(separator)
        self.salt = salt or None

    def salted(self, salt: str | None) -> SegmentCache:
        """This cache in the namespace of ``salt`` (itself when the namespace is the same)."""
        if (salt or None) == self.salt:
            return self
        return SegmentCache(self.store, self.fingerprint, self.pattern, salt)

    def segments(self, tokens: Sequence[int]) -> list[Segment]:
        """Every segment of ``tokens``, the query tail included."""
        return self.pattern.split(tokens)

    def query_start(self, tokens: Sequence[int]) -> int:
        """Where the query tail starts: tokens from there on are never served nor stored."""
        return self.pattern.query_start(tokens)

    def cacheable_segments(self, tokens: Sequence[int]) -> list[Segment]:
        """The units a computed prompt stores (never the query tail)."""
        return self.pattern.store_units(tokens)

    def key(self, tokens: Sequence[int], segment: Segment) -> str:
        return segment_key(self.fingerprint, tokens[segment.start : segment.end], self.salt)

    def keys(self, tokens: Sequence[int], segments: Sequence[Segment]) -> list[str]:
        spans = [(s.start, s.end) for s in segments]
        return segment_keys(self.fingerprint, tokens, spans, self.salt)

    def cached(self, tokens: Sequence[int]) -> list[tuple[Segment, bool]]:
        """Each unit a computed prompt stores, with whether the store holds it (nothing is
        loaded)."""
        units = self.cacheable_segments(tokens)
        return [(s, self.store.contains(k)) for s, k in zip(units, self.keys(tokens, units))]

    def match(self, tokens: Sequence[int]) -> list[Segment]:
        """The segments of ``tokens`` the store holds, never in the query tail."""
        return self.pattern.match(
            tokens, lambda segs: [self.store.contains(k) for k in self.keys(tokens, segs)]
        )

    def lookup(self, tokens: Sequence[int]) -> list[tuple[Segment, SegmentKV | None]]:
        """Each held segment (see :meth:`match`) with its K/V, or None when the entry is gone
        or unusable."""
        return [(seg, self._load(tokens, seg)) for seg in self.match(tokens)]

    def _load(self, tokens: Sequence[int], segment: Segment) -> SegmentKV | None:
        # the length travels with the lookup: a tier refuses (and removes) a value of another
        kv = self.store.get(self.key(tokens, segment), len(segment))
        if kv is None:
            return None
        fp = self.fingerprint
        expected = (fp.num_layers, len(segment), fp.num_kv_heads, fp.head_dim)
        if tuple(kv.keys.shape) != expected or kv.start_position < 0:
            logger.warning(
                "cached segment at tokens %d..%d has shape %s (start %d), expected %s; "
                "recomputing it",
                segment.start,
                segment.end,
                tuple(kv.keys.shape),
                kv.start_position,
                expected,
            )
            return None
        return kv

    def store_segments(
        self,
        tokens: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        only: Sequence[Segment] | None = None,
    ) -> int:
        """Store cacheable segments of a computed prompt; returns how many new entries were
        written.

        Args:
            tokens: the prompt, ``T`` ids.
            keys, values: per layer ``[T, Hkv, D]`` (post-RoPE keys at positions ``0..T-1``).
            only: store just these segments (default: every cacheable segment); the query tail
                is skipped whatever is asked.
        """
        stored = 0
        for segment in self.cacheable_segments(tokens) if only is None else only:
            rows = slice(segment.start, segment.end)
            stored += self.store_segment(
                tokens, segment, [k[rows] for k in keys], [v[rows] for v in values]
            )
        return stored

    def store_segment(
        self,
        tokens: Sequence[int],
        segment: Segment,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> int:
        """Store one segment from its own rows: per layer ``[len(segment), Hkv, D]`` K and V
        (keys rotated at positions ``segment.start ..``), computed after ``tokens`` before it,
        which the entry records as its provenance
        (:mod:`lmcache_backend.blend.segments.provenance`). Returns 1 if a new entry was written, 0
        if it was already held, too large, or the query tail."""
        if segment.end > self.query_start(tokens) or len(segment) == 0:
            return 0
        key = self.key(tokens, segment)
        if self.store.contains(key):
            return 0
        kv = SegmentKV(
            keys=torch.stack(list(keys)),
            values=torch.stack(list(values)),
            start_position=segment.start,
            context=context_digest(tokens[: segment.start]),
            preceding=self.preceding_tags(tokens, segment),
        )
        return int(self.store.put(key, kv))

    def preceding_tags(self, tokens: Sequence[int], segment: Segment) -> tuple[str, ...]:
        """The tags of the units of ``tokens`` a computed prompt stores that end before
        ``segment`` starts, in order (a stored segment's ``preceding``)."""
        before = [u for u in self.cacheable_segments(tokens) if u.end <= segment.start]
        return tuple(unit_tag(key) for key in self.keys(tokens, before))
