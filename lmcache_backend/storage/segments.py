"""The segment store's interface: per-layer K/V of token segments, keyed by model and tokens.

A key is ``sha256(model fingerprint, segment token ids)``, so a segment is never served to another
model or configuration. A value (:class:`SegmentKV`) holds every layer's K (post-RoPE, rotated at
the positions it was computed at) and V, plus the position of its first token.

This module holds the key, the value and the store interface; the tiers (device, CPU, disk, Redis)
live beside it in :mod:`lmcache_backend.storage`.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_backend.models.fingerprint import ModelFingerprint


def segment_key(fingerprint: ModelFingerprint, tokens: Sequence[int] | torch.Tensor) -> str:
    """Hex key of one segment: ``sha256(fingerprint digest, token ids as little-endian int64)``."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    h = hashlib.sha256(fingerprint.digest())
    h.update(struct.pack(f"<{len(ids)}q", *ids))
    return h.hexdigest()


def segment_keys(
    fingerprint: ModelFingerprint, tokens: Sequence[int], spans: Sequence[tuple[int, int]]
) -> list[str]:
    """:func:`segment_key` of ``tokens[start:end]`` for each ``(start, end)`` span (the
    fingerprint is hashed once: the separator-free lookup keys a window at every offset)."""
    ids = list(tokens)
    base = hashlib.sha256(fingerprint.digest())
    keys = []
    for start, end in spans:
        h = base.copy()
        h.update(struct.pack(f"<{end - start}q", *ids[start:end]))
        keys.append(h.hexdigest())
    return keys


@dataclass
class SegmentKV:
    """Cached K/V of one segment.

    Attributes:
        keys: ``[L, n, Hkv, D]`` post-RoPE keys, rotated at positions
            ``start_position .. start_position + n - 1``.
        values: ``[L, n, Hkv, D]``.
        start_position: position of the segment's first token when it was computed.
    """

    keys: torch.Tensor
    values: torch.Tensor
    start_position: int

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(
                f"SegmentKV: keys {tuple(self.keys.shape)} and values "
                f"{tuple(self.values.shape)} must both be [layers, tokens, kv_heads, head_dim]"
            )

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class SegmentStore(ABC):
    """Key -> :class:`SegmentKV`. Implementations are thread-safe."""

    @abstractmethod
    def get(self, key: str) -> SegmentKV | None:
        """The entry for ``key``, or ``None`` on a miss."""

    @abstractmethod
    def put(self, key: str, kv: SegmentKV) -> bool:
        """Store ``kv`` under ``key``; returns whether it was stored (an entry larger than the
        capacity is skipped). An existing entry is kept: the first computation of a segment wins,
        so concurrent stores of one segment cannot mix halves of two computations."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``get(key)`` would hit, without loading the value."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every entry."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the entries."""
