"""Saving: the segments of a prompt whose K/V are complete in the paged cache go to the store.

Whichever path computed a prompt (vLLM's prefill or a blend), its segments are read back from the
paged cache after the step's forward pass, those the store lacks. A segment holding rows a blend
reused from the store is not stored again: its K/V are not a computation of its own. Segments are
stored under the request's ``cache_salt``: another salt never finds them.

A staleness probe's save (``lmcache.staleness_probes``) stores nothing: it measures the stored
segments the prompt holds against their rows here
(:mod:`lmcache_backend.blend.segments.staleness_prior`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lmcache_backend.blend.segments.segment_cache import SegmentCache
from lmcache_backend.blend.segments.staleness_prior import ProbeAccumulator, measure_probe
from lmcache_backend.integration.vllm.layouts import slots_for
from lmcache_backend.integration.vllm.metadata import SaveSpec
from lmcache_backend.logtext import shorten

logger = logging.getLogger(__name__)

#: requests whose reused rows are kept at most: vLLM reports every finished request
#: (:meth:`SegmentSaver.forget`); the bound only guards memory against an engine that does not
_MAX_PENDING = 4096

#: ``slots [N] -> (keys, values)``, per layer ``[N, Hkv, D]`` each, read from the paged cache
ReadRows = Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]


class SegmentSaver:
    """Stores the segments of completed prompts.

    Args:
        segments: the store seen as segments of prompts.
        read_rows: reads every layer's K/V rows at some slots of the paged cache.
        block_size: tokens per block of the paged cache.
        model, ops: the model adapter and ops a staleness probe re-rotates stored keys with
            (None: probes are not measured, logged once).
    """

    def __init__(
        self,
        segments: SegmentCache,
        read_rows: ReadRows,
        block_size: int,
        model: Any = None,
        ops: Any = None,
    ) -> None:
        self.segments = segments
        self.read_rows = read_rows
        self.block_size = block_size
        self.model, self.ops = model, ops
        self.stored_segments = 0
        #: entries given a staleness prior by probes
        self.priors_written = 0
        self._probes = ProbeAccumulator(_MAX_PENDING)
        # request -> [T] bool: rows blended from the store (not vLLM's prefix)
        self._reused: dict[str, torch.Tensor] = {}

    def blended(self, req_id: str, valid_mask: torch.Tensor, prefix_len: int) -> None:
        """A blend of ``req_id`` reused the rows of ``valid_mask`` (``[T]`` bool); its first
        ``prefix_len`` were vLLM's own prefix-cache rows."""
        reused = valid_mask.clone()
        reused[:prefix_len] = False
        if bool(reused.any()):
            self._reused[req_id] = reused
            while len(self._reused) > _MAX_PENDING:
                self._reused.pop(next(iter(self._reused)))

    def forget(self, req_id: str) -> None:
        """``req_id`` finished (or was aborted) before its save: drop what was kept for it."""
        self._reused.pop(req_id, None)

    @torch.inference_mode()
    def save(self, spec: SaveSpec) -> int:
        """Store the segments of ``spec``'s prompt the store lacks; returns how many."""
        tokens = spec.token_ids
        # consumed by the save it was kept for (a request preempted and prefilled again by
        # vLLM saves its own K/V next time)
        reused = self._reused.pop(spec.req_id, None)
        segments = self.segments.salted(spec.cache_salt)
        if spec.probes > 0:
            self._probe(spec, segments)
            return 0
        # cached() covers the chunks only: the query tail is never stored. A unit holding rows
        # blended from the store is not stored either (separator-free blocks can overlap a
        # reused block found at another offset).
        missing = [
            seg
            for seg, hit in segments.cached(tokens)
            if not hit and (reused is None or not bool(reused[seg.start : seg.end].any()))
        ]
        if not missing:
            return 0
        slots = slots_for(spec.block_ids, self.block_size, 0, len(tokens))
        stored = 0
        for segment in missing:  # read back only the rows of the segments to store
            keys, values = self.read_rows(slots[segment.start : segment.end])
            stored += segments.store_segment(tokens, segment, keys, values)
        self.stored_segments += stored
        logger.debug("request %s: stored %d segments", shorten(str(spec.req_id)), stored)
        return stored

    def _probe(self, spec: SaveSpec, segments: SegmentCache) -> None:
        """Measure a staleness probe's held segments (see the module docstring)."""
        if self.model is None:
            logger.warning(
                "request %s: a staleness probe needs the model; not measured", spec.req_id
            )
            return
        slots = slots_for(spec.block_ids, self.block_size, 0, len(spec.token_ids))

        def rows_of(segment: Any) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.read_rows(slots[segment.start : segment.end])
            return torch.stack(list(keys)), torch.stack(list(values))

        written = measure_probe(
            segments, spec.token_ids, rows_of, spec.probes, self._probes, self.model, self.ops
        )
        self.priors_written += written
        logger.debug("request %s: a probe gave %d priors", shorten(str(spec.req_id)), written)
