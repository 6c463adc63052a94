"""Prompt segments <-> the segment store, for one model.

Looks segments up (validating each entry's layout against the model before use) and stores the
K/V of a prompt's segments after it was computed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmcache_backend.segmenting import Segment, split_segments
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
        return split_segments(tokens, self.separator)

    def key(self, tokens: Sequence[int], segment: Segment) -> str:
        return segment_key(self.fingerprint, tokens[segment.start : segment.end])

    def cached(self, tokens: Sequence[int]) -> list[tuple[Segment, bool]]:
        """Each segment with whether the store holds it (no value is loaded)."""
        return [(seg, self.store.contains(self.key(tokens, seg))) for seg in self.segments(tokens)]

    def lookup(self, tokens: Sequence[int]) -> list[tuple[Segment, SegmentKV | None]]:
        """Each segment with its cached K/V, or None on a miss or an unusable entry."""
        return [(seg, self._load(tokens, seg)) for seg in self.segments(tokens)]

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
        """Store segments of a computed prompt; returns how many new entries were written.

        Args:
            tokens: the prompt, ``T`` ids.
            keys, values: per layer ``[T, Hkv, D]`` (post-RoPE keys at positions ``0..T-1``).
            only: store just these segments (default: every segment).
        """
        stored = 0
        for segment in self.segments(tokens) if only is None else only:
            key = self.key(tokens, segment)
            if self.store.contains(key):
                continue
            kv = SegmentKV(
                keys=torch.stack([k[segment.start : segment.end] for k in keys]),
                values=torch.stack([v[segment.start : segment.end] for v in values]),
                start_position=segment.start,
            )
            stored += int(self.store.put(key, kv))
        return stored
