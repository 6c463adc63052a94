"""Prompt segments <-> the segment store, for one model.

Looks segments up (validating each entry's layout against the model before use) and stores the
K/V of a prompt's segments after it was computed.

Only segments that end with the separator (the system part and the chunks) are cached. The tail
after the last separator is the query: the question and the assistant header. It is new in every
real RAG request, so it is never served from the store (even when an earlier prompt held the same
question, its K/V were computed against another context) and never stored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmcache_backend.segmenting import (
    Segment,
    cacheable_segments,
    ends_with_separator,
    split_segments,
)
from lmcache_backend.store import ModelFingerprint, SegmentKV, SegmentStore, segment_key

logger = logging.getLogger(__name__)


class SegmentCache:
    """Segment lookups and stores for one model and one separator."""

    def __init__(
        self, store: SegmentStore, fingerprint: ModelFingerprint, separator: Sequence[int]
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.separator = [int(t) for t in separator]
        if not self.separator:
            raise ValueError("the separator must hold at least one token id")

    def segments(self, tokens: Sequence[int]) -> list[Segment]:
        """Every segment of ``tokens``, the query tail included."""
        return split_segments(tokens, self.separator)

    def cacheable(self, tokens: Sequence[int], segment: Segment) -> bool:
        """Whether ``segment`` ends with the separator, i.e. is a chunk and not the query tail."""
        return ends_with_separator(tokens, segment, self.separator)

    def cacheable_segments(self, tokens: Sequence[int]) -> list[Segment]:
        """The segments that may be served from and stored to the store (not the query tail)."""
        return cacheable_segments(tokens, self.separator)

    def key(self, tokens: Sequence[int], segment: Segment) -> str:
        return segment_key(self.fingerprint, tokens[segment.start : segment.end])

    def cached(self, tokens: Sequence[int]) -> list[tuple[Segment, bool]]:
        """Each cacheable segment with whether the store holds it (no value is loaded)."""
        return [
            (seg, self.store.contains(self.key(tokens, seg)))
            for seg in self.cacheable_segments(tokens)
        ]

    def lookup(self, tokens: Sequence[int]) -> list[tuple[Segment, SegmentKV | None]]:
        """Each segment with its cached K/V, or None on a miss, an unusable entry or the query
        tail (never served from the store)."""
        return [
            (seg, self._load(tokens, seg) if self.cacheable(tokens, seg) else None)
            for seg in self.segments(tokens)
        ]

    def _load(self, tokens: Sequence[int], segment: Segment) -> SegmentKV | None:
        kv = self.store.get(self.key(tokens, segment))
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
        (keys rotated at positions ``segment.start ..``). Returns 1 if a new entry was written,
        0 if it was already held, too large, or the query tail."""
        if not self.cacheable(tokens, segment):
            return 0
        key = self.key(tokens, segment)
        if self.store.contains(key):
            return 0
        kv = SegmentKV(
            keys=torch.stack(list(keys)),
            values=torch.stack(list(values)),
            start_position=segment.start,
        )
        return int(self.store.put(key, kv))
