"""The segment store's interface: per-layer K/V of token segments, keyed by model and tokens.

A key is ``sha256(key seed, segment token ids)``, the seed being the model fingerprint's digest,
or, for a request with a ``cache_salt``, a digest of the fingerprint and the salt: a segment is
never served to another model or configuration, nor across salts (tenants). A value
(:class:`SegmentKV`) holds every layer's K (post-RoPE, rotated at the positions it was computed
at) and V, plus the position of its first token.

This module holds the key, the value and the store interface; the tiers (device, CPU, disk, Redis)
live beside it in :mod:`lmcache_backend.storage`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_backend.models.fingerprint import ModelFingerprint

#: Separates the salted seed's hash input from every other sha256 input of the package.
_SALT_DOMAIN = b"\x00lmcache_backend.cache_salt.v1\x00"


def key_seed(fingerprint: ModelFingerprint, salt: str | None = None) -> bytes:
    """The 32 bytes every key of a namespace starts from.

    Without a salt (``None`` or ``""``, as vLLM treats an empty salt) the fingerprint's digest,
    so unsalted keys are those of earlier releases. With one,
    ``sha256(domain, fingerprint digest, len(salt), salt)``: 32 bytes as well, so the token ids
    that follow can never make a salted key equal an unsalted one or another salt's.
    """
    digest = fingerprint.digest()
    if not salt:
        return digest
    # surrogatepass: a JSON string may hold a lone surrogate ("\ud800"), which plain UTF-8
    # refuses to encode; it is still a distinct salt
    raw = str(salt).encode("utf-8", "surrogatepass")
    h = hashlib.sha256(_SALT_DOMAIN)
    h.update(digest)
    h.update(struct.pack("<Q", len(raw)))
    h.update(raw)
    return h.digest()


def segment_key(
    fingerprint: ModelFingerprint,
    tokens: Sequence[int] | torch.Tensor,
    salt: str | None = None,
) -> str:
    """Hex key of one segment: ``sha256(key_seed(fingerprint, salt), token ids as
    little-endian int64)``."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    h = hashlib.sha256(key_seed(fingerprint, salt))
    h.update(struct.pack(f"<{len(ids)}q", *ids))
    return h.hexdigest()


def segment_keys(
    fingerprint: ModelFingerprint,
    tokens: Sequence[int],
    spans: Sequence[tuple[int, int]],
    salt: str | None = None,
) -> list[str]:
    """:func:`segment_key` of ``tokens[start:end]`` for each ``(start, end)`` span (the seed is
    hashed once: the separator-free lookup keys a window at every offset)."""
    ids = list(tokens)
    base = hashlib.sha256(key_seed(fingerprint, salt))
    keys = []
    for start, end in spans:
        h = base.copy()
        h.update(struct.pack(f"<{end - start}q", *ids[start:end]))
        keys.append(h.hexdigest())
    return keys


#: hex characters of a segment key kept in another entry's provenance (``preceding``)
UNIT_TAG_CHARS = 16


def context_digest(tokens: Sequence[int] | torch.Tensor) -> str:
    """Hex ``sha256`` of the token ids before a segment (``tokens``: every id from position 0
    to the segment's start): two computations of a segment after equal digests saw the same
    context, so one's K/V are exactly the other's."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def unit_tag(key: str) -> str:
    """The part of a segment key an entry's ``preceding`` keeps."""
    return key[:UNIT_TAG_CHARS]


@dataclass
class SegmentKV:
    """Cached K/V of one segment.

    Attributes:
        keys: ``[L, n, Hkv, D]`` post-RoPE keys, rotated at positions
            ``start_position .. start_position + n - 1``.
        values: ``[L, n, Hkv, D]``.
        start_position: position of the segment's first token when it was computed.
        context: :func:`context_digest` of the tokens before the segment when it was computed
            (its provenance; None: unknown, an entry written before provenance was recorded).
        preceding: :func:`unit_tag` of each stored unit before the segment in that prompt, in
            order (empty: computed with nothing but unstored text before it; None: unknown).
        staleness: ``[L, n]`` fp16 per-token, per-layer staleness prior: how far each token's
            K/V moved when the segment was computed after other text (``lmcache-backend ingest
            --staleness-probes``), or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    start_position: int
    context: str | None = None
    preceding: tuple[str, ...] | None = None
    staleness: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(
                f"SegmentKV: keys {tuple(self.keys.shape)} and values "
                f"{tuple(self.values.shape)} must both be [layers, tokens, kv_heads, head_dim]"
            )
        if self.staleness is not None and tuple(self.staleness.shape) != tuple(self.keys.shape[:2]):
            raise ValueError(
                f"SegmentKV: staleness {tuple(self.staleness.shape)} must be [layers, tokens] "
                f"{tuple(self.keys.shape[:2])}"
            )

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.staleness is None else self.staleness.nbytes
        return self.keys.nbytes + self.values.nbytes + extra

    def with_tensors(self, keys: torch.Tensor, values: torch.Tensor) -> SegmentKV:
        """This entry with other K/V tensors (a copy, another device), its provenance and
        staleness prior kept."""
        return dataclasses.replace(self, keys=keys, values=values)


class SegmentStore(ABC):
    """Key -> :class:`SegmentKV`. Implementations are thread-safe."""

    @abstractmethod
    def get(self, key: str, num_tokens: int | None = None) -> SegmentKV | None:
        """The entry for ``key``, or ``None`` on a miss.

        ``num_tokens``: the segment's length, when the caller knows it; an entry of another
        length is not the segment's (a damaged or forged value) and is refused."""

    @abstractmethod
    def put(self, key: str, kv: SegmentKV) -> bool:
        """Store ``kv`` under ``key``; returns whether it was stored (an entry larger than the
        capacity is skipped). An existing entry is kept: the first computation of a segment wins,
        so concurrent stores of one segment cannot mix halves of two computations."""

    def replace(self, key: str, kv: SegmentKV) -> bool:
        """Store ``kv`` under ``key`` in place of the entry there: the same segment with more
        to it (its staleness prior), never another computation of it. Returns whether it was
        stored. The default: not supported (False)."""
        return False

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
