"""A stored segment's staleness prior: how far each of its tokens' K/V move when the segment is
computed after other text, measured once where the segment is stored (``lmcache-backend ingest
--staleness-probes``, ``bench --staleness-probes``) and read by every later blend
(:mod:`lmcache_backend.blend.selectors.staleness`).

A probe computes the segment after a few other passages (a probe context) and compares its K/V
with the stored ones, keys re-rotated to the probe's positions: per layer and token, the L2 norm
of the key and value differences together. The prior is the mean over the probes; its entry keeps
it in fp16 (``[L, n]``: ``2 L`` bytes a token beside the K/V's ``4 L Hkv D`` in bf16).

On real passages (MuSiQue, SmolLM2) the prior ranks a segment's tokens by their true deviation
in a new prompt about as well as the token's offset in its chunk does (Spearman 0.5-0.7), and
unlike the offset it also says which chunks move more than others.

Shapes: ``L`` layers, ``n`` tokens of the segment, ``Hkv`` KV heads, ``D`` head dim.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch

from lmcache_backend.blend.segmenting import Segment
from lmcache_backend.blend.segments.segment_cache import SegmentCache
from lmcache_backend.models.base import ModelAdapter
from lmcache_backend.ops import Ops
from lmcache_backend.storage.segments import SegmentKV, context_digest

#: a computed prompt's rows of one segment: ``(keys, values)``, ``[L, n, Hkv, D]`` each
SegmentRows = Callable[[Segment], tuple[torch.Tensor, torch.Tensor]]

#: the largest value an fp16 prior holds
_FP16_MAX = float(torch.finfo(torch.float16).max)


def rerotated_keys(
    keys: torch.Tensor, old_start: int, new_start: int, model: ModelAdapter, ops: Ops
) -> torch.Tensor:
    """A copy of ``keys [L, n, Hkv, D]`` (rotated at ``old_start ..``) rotated to ``new_start
    ..``, each layer with its own rotation table, on the engine's kernel where it has one."""
    out = keys.clone()
    layers, n, heads, dim = out.shape
    if old_start == new_start or n == 0:
        return out
    device = out.device
    old = torch.arange(old_start, old_start + n, device=device)
    new = torch.arange(new_start, new_start + n, device=device)
    for table, group in model.rotation_groups():
        index = torch.tensor(group, device=device)
        picked = out[index].contiguous()  # [Lg, n, Hkv, D]
        if model.rope_rerotate_k is not None and not ops.native("rope_rerotate_k"):
            model.rope_rerotate_k(
                picked.view(len(group) * n, heads, dim),
                old.repeat(len(group)),
                new.repeat(len(group)),
                table,
            )
        else:
            turned = picked.transpose(0, 1).contiguous()  # [n, Lg, Hkv, D]
            ops.rope_rerotate_k(
                turned.view(n, len(group) * heads, dim), old, new, table, model.is_neox
            )
            picked = turned.transpose(0, 1)
        out[index] = picked
    return out


def probe_deviation(
    stored: SegmentKV,
    probe_keys: torch.Tensor,
    probe_values: torch.Tensor,
    probe_start: int,
    model: ModelAdapter,
    ops: Ops,
) -> torch.Tensor:
    """``[L, n]`` fp32: per layer and token, ``||k_probe - k_stored|| + ...``, precisely
    ``sqrt(|k_probe - k_stored|^2 + |v_probe - v_stored|^2)`` summed over heads and dims, the
    stored keys re-rotated to the probe's positions (``probe_keys``/``probe_values``: the
    segment's ``[L, n, Hkv, D]`` computed at ``probe_start ..`` after a probe context)."""
    device = probe_keys.device
    keys = rerotated_keys(
        stored.keys.to(device, probe_keys.dtype), stored.start_position, probe_start, model, ops
    )
    dk = (probe_keys.float() - keys.float()).pow(2).sum(dim=(-1, -2))
    dv = (probe_values.float() - stored.values.to(device).float()).pow(2).sum(dim=(-1, -2))
    return (dk + dv).sqrt().cpu()


def with_prior(stored: SegmentKV, prior: torch.Tensor) -> SegmentKV:
    """``stored`` with the staleness prior ``prior [L, n]`` (kept in fp16)."""
    return dataclasses.replace(
        stored, staleness=prior.clamp(0.0, _FP16_MAX).to(torch.float16).contiguous()
    )


class ProbeAccumulator:
    """Probe measurements per segment key until each has ``probes`` of them, then the mean
    (thread-safe; at most ``max_pending`` segments are waiting, the oldest dropped first)."""

    def __init__(self, max_pending: int = 4096) -> None:
        self.max_pending = max_pending
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}
        self._lock = threading.Lock()

    def add(self, key: str, deviation: torch.Tensor, probes: int) -> torch.Tensor | None:
        """Add one probe's ``deviation [L, n]`` of segment ``key``; the mean once ``probes``
        were added (and ``key`` is forgotten), else None."""
        with self._lock:
            total, count = self._sums.pop(key, (torch.zeros_like(deviation), 0))
            if total.shape != deviation.shape:  # another segment under the key: start over
                total, count = torch.zeros_like(deviation), 0
            total, count = total + deviation, count + 1
            if count >= probes:
                return total / count
            self._sums[key] = (total, count)
            while len(self._sums) > self.max_pending:
                self._sums.pop(next(iter(self._sums)))
            return None


def measure_probe(
    cache: SegmentCache,
    tokens: Sequence[int],
    rows_of: SegmentRows,
    probes: int,
    pending: ProbeAccumulator,
    model: ModelAdapter,
    ops: Ops,
) -> int:
    """One probe: the computed prompt ``tokens`` (its rows per segment from ``rows_of``) ends
    with the chunk it probes, after a probe context: that last stored unit is measured against
    its entry, unless computed in this very context or measured already; the entry gets its
    prior (:meth:`~lmcache_backend.storage.segments.SegmentStore.replace`) once ``probes`` probes
    measured it. The probe context's own chunks are not measured (they sit where the probes'
    fixed contexts put them, every time), nothing is stored. Returns the entries given a prior
    (0 or 1)."""
    held = [segment for segment, present in cache.cached(tokens) if present]
    if not held:
        return 0
    segment = held[-1]
    key = cache.key(tokens, segment)
    stored = cache.store.get(key)
    if stored is None or stored.num_tokens != len(segment) or stored.staleness is not None:
        return 0  # gone, not this segment, or measured already
    if stored.start_position == segment.start and stored.context == context_digest(
        tokens[: segment.start]
    ):
        return 0  # computed in this very context: nothing moved
    keys, values = rows_of(segment)
    deviation = probe_deviation(stored, keys, values, segment.start, model, ops)
    mean = pending.add(key, deviation, probes)
    written = 0
    if mean is not None:
        written = int(cache.store.replace(key, with_prior(stored, mean)))
    return written
