"""Where a reused segment's K/V came from, against where the prompt now puts it.

Every stored segment records what preceded it when it was computed (its provenance,
:class:`~lmcache_backend.storage.segments.SegmentKV`): a digest of those tokens and the tags of
the stored units among them. A segment computed after exactly the tokens that now precede it
(the first chunk after the same system part, a chunk a request stored in the same order) holds
the K/V a full prefill computes: nothing to recompute. One computed alone (``lmcache-backend
ingest``) or in another order saw another context than its present one:
:attr:`HitContext.distance` says how far, as the share of the units before it, then or now, that
were not before it both times.

Shapes: ``T`` tokens of the prompt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_backend.blend.segmenting import Segment
from lmcache_backend.storage.segments import SegmentKV, unit_tag


@dataclass(frozen=True)
class HitContext:
    """A reused segment's provenance against its place in this prompt.

    Attributes:
        start, length: the segment's tokens in this prompt.
        exact: it was computed after exactly the tokens now before it (its K/V are full
            prefill's); False also when its provenance is unknown.
        distance: how far its context then is from its context now: ``1 - |then & now| /
            |then | now|`` over the stored units before it (0: the same units, 1: none in
            common; 0 when exact or when nothing was ever before it); None when its provenance
            is unknown (an entry written before provenance was recorded). A chunk encoded alone
            after the system part, now the ``k``-th chunk after it, is ``1 - 1/k`` away.
    """

    start: int
    length: int
    exact: bool
    distance: float | None


def prefix_digests(tokens: Sequence[int], starts: Sequence[int]) -> dict[int, str]:
    """:func:`~lmcache_backend.storage.segments.context_digest` of ``tokens[:s]`` for every
    ``s`` in ``starts``, hashing the prompt once."""
    digests: dict[int, str] = {}
    h = hashlib.sha256()
    done = 0
    for start in sorted(set(starts)):
        h.update(struct.pack(f"<{start - done}q", *tokens[done:start]))
        done = start
        digests[start] = h.copy().hexdigest()
    return digests


def hit_contexts(
    tokens: Sequence[int],
    hits: Sequence[tuple[int, SegmentKV]],
    units: Sequence[Segment],
    unit_keys: Sequence[str],
) -> list[HitContext]:
    """One :class:`HitContext` per hit ``(start, kv)`` of ``tokens``, whose stored units are
    ``units`` (in order) with keys ``unit_keys``."""
    digests = prefix_digests(tokens, [start for start, _ in hits])
    tags = [unit_tag(key) for key in unit_keys]
    out = []
    for start, kv in hits:
        if kv.context is None:
            out.append(HitContext(start, kv.num_tokens, False, None))
            continue
        exact = kv.context == digests[start] and kv.start_position == start
        distance = None
        if kv.preceding is not None:
            then = set(kv.preceding)
            now = {tag for u, tag in zip(units, tags) if u.end <= start}
            union = then | now
            distance = 0.0 if exact or not union else 1.0 - len(then & now) / len(union)
        out.append(HitContext(start, kv.num_tokens, exact, distance))
    return out


def exact_rows(contexts: Sequence[HitContext], num_tokens: int) -> torch.Tensor:
    """``[T]`` bool: the rows of the hits whose K/V are exact (see :attr:`HitContext.exact`)."""
    rows = torch.zeros(num_tokens, dtype=torch.bool)
    for ctx in contexts:
        if ctx.exact:
            rows[ctx.start : ctx.start + ctx.length] = True
    return rows


def exact_run(contexts: Sequence[HitContext], start: int = 0) -> int:
    """The end of the run of exact hits from ``start`` (``start`` itself when the hit there is
    not exact): leading tokens a full prefill would compute the same way."""
    end = start
    for ctx in sorted(contexts, key=lambda c: c.start):
        if ctx.start == end and ctx.exact:
            end = ctx.start + ctx.length
        elif ctx.start >= end:
            break
    return end
