"""Loads: blend each claimed prompt into its blocks, at once or a few layers per step.

A **synchronous** load (``start_load_kv`` before the step's forward pass) blends the whole claim
before vLLM computes the question tail in the same step.

A **sliced** load (``blend_layers_per_step > 0``, :attr:`LoadSpec.sliced`) starts a blend that
advances that many layer passes per step (preview layers count), the oldest blend first; once it
completes, the request is reported in ``finished_recving`` (``get_finished``) and vLLM schedules
its tail. Its rows stop at the claim's end (vLLM allocated no blocks for the tail) and the
blender runs with ``strict_end``: no blend layer computes a tail token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_backend.blend import BlendRequest, BlendResult, LMCBlender
from lmcache_backend.blend.blender import run_to_end
from lmcache_backend.blend.timing import NO_TIMER, PhaseTimer
from lmcache_backend.integration.vllm.layouts import slots_for
from lmcache_backend.integration.vllm.metadata import LoadSpec
from lmcache_backend.integration.vllm.reporting.stats import LoadTiming
from lmcache_backend.integration.vllm.worker_side.paged_target import PagedCacheTarget
from lmcache_backend.integration.vllm.worker_side.saves import ReadRows
from lmcache_backend.logtext import shorten

logger = logging.getLogger(__name__)

#: ``(spec, result, paged_layers, timing, phase milliseconds)``: a load completed
LoadDone = Callable[[LoadSpec, BlendResult, int, LoadTiming, dict[str, float]], Any]


@dataclass
class _Sliced:
    """A sliced blend in flight (``blend_layers_per_step``)."""

    spec: LoadSpec
    passes: Generator[tuple[str, int], None, BlendResult]
    target: PagedCacheTarget
    timer: Any
    started: float
    busy_s: float = 0.0
    steps: int = 0
    last: tuple[str, int] | None = None


class Loads:
    """Runs the step's loads.

    Args:
        blender: the engine's blender (one for every request).
        target: the synchronous loads' target (the engine's paged cache).
        read_rows: reads every layer's K/V at some slots (vLLM's prefix-cache rows).
        block_size: tokens per block.
        layers_per_step: ``blend_layers_per_step``.
        time_phases: time each load's phases.
        done: receives every completed load.
    """

    def __init__(
        self,
        blender: LMCBlender,
        target: PagedCacheTarget,
        read_rows: ReadRows,
        block_size: int,
        layers_per_step: int,
        time_phases: bool,
        done: LoadDone,
    ) -> None:
        self.blender, self.target, self.read_rows = blender, target, read_rows
        self.block_size, self.layers_per_step = block_size, layers_per_step
        self.time_phases, self.done = time_phases, done
        self.timer = PhaseTimer() if time_phases else NO_TIMER
        self.sliced: dict[str, _Sliced] = {}  # in flight, oldest first
        self._finished: set[str] = set()  # sliced loads done (or cancelled) this step

    def _passes(
        self, spec: LoadSpec, target: PagedCacheTarget, timer: Any
    ) -> Generator[tuple[str, int], None, BlendResult]:
        """Point ``target`` at ``spec``'s rows, read vLLM's prefix rows back; returns the
        blend's passes (not started).

        Attention over the paged cache needs every row it computes there. A synchronous load's
        blocks cover the whole prompt: the check layers before the selection is final compute
        the tail (vLLM rewrites those rows when it computes the tail in its own forward pass,
        after the blend). A sliced load's blocks stop at the claim's end: its rows stop there
        and the blender runs with ``strict_end`` (no blend layer computes a tail token; the
        scheduler slices only the selections for which that changes nothing).
        """
        num_tokens = len(spec.token_ids)
        need = spec.end if spec.sliced else num_tokens
        attend = len(spec.block_ids) * self.block_size >= need
        stop = need if attend else spec.end
        slots = slots_for(spec.block_ids, self.block_size, 0, stop)
        prefix = self.read_rows(slots[: spec.prefix_len]) if spec.prefix_len else None
        timer.lap("prefix read")
        block_ids = torch.as_tensor(spec.block_ids, dtype=torch.int64) if attend else None
        target.point_at(slots[spec.prefix_len :], spec.prefix_len, stop, block_ids, num_tokens)
        request = BlendRequest(
            token_ids=spec.token_ids,
            cached_prefix=prefix,
            compute_end=spec.end,
            strict_end=spec.sliced,
            config=spec.config,
            cache_salt=spec.cache_salt,
        )
        return self.blender.run(request, target, timer)

    @torch.inference_mode()
    def load(self, spec: LoadSpec) -> Any:
        """Blend ``spec``'s prompt now and write tokens ``prefix_len..end-1`` into its blocks."""
        started = time.perf_counter()
        self.timer.start()
        result = run_to_end(self._passes(spec, self.target, self.timer))
        paged_layers = self.target.paged_layers
        self.target.release()
        elapsed = time.perf_counter() - started
        timing = LoadTiming(elapsed, elapsed)
        return self.done(spec, result, paged_layers, timing, self.timer.milliseconds())

    @torch.inference_mode()
    def start(self, spec: LoadSpec) -> None:
        """Start ``spec``'s sliced blend; it advances in :meth:`advance`."""
        started = time.perf_counter()
        timer = PhaseTimer() if self.time_phases else NO_TIMER
        target = self.target.for_sliced_loads()
        job = _Sliced(spec, self._passes(spec, target, timer), target, timer, started)
        job.busy_s = time.perf_counter() - started
        self.sliced[spec.req_id] = job

    def cancel(self, req_id: str) -> None:
        """Drop the blend of a request finished (aborted) while it was in flight: nothing writes
        its blocks again; it is reported in ``finished_recving`` so vLLM frees them. A request
        whose blend already completed (and was reported) is not reported again."""
        job = self.sliced.pop(req_id, None)
        if job is None:
            return
        job.passes.close()
        self._finished.add(req_id)
        logger.info(
            "CacheBlend request %s finished while blending: blend dropped after %d steps",
            shorten(str(req_id)),
            job.steps,
        )

    @torch.inference_mode()
    def advance(self, last_layer: int) -> None:
        """Run ``blend_layers_per_step`` layer passes of the blends in flight, oldest first;
        a blend that completes is reported in ``finished_recving``. A preview through vLLM's
        forward pass (all its layers in one pass, about as long as a few blend layers) ends the
        step it ran in. The count never depends on time: tensor-parallel ranks run the same
        passes (and collectives) in the same order. ``last_layer``: the model's last layer."""
        budget = self.layers_per_step
        stepped: set[str] = set()
        while self.sliced and budget > 0:
            job = next(iter(self.sliced.values()))
            if job.spec.req_id not in stepped:
                stepped.add(job.spec.req_id)
                job.steps += 1
            if self._step(job):
                budget -= 1
                if job.last == ("preview", last_layer) and job.target.engine_previewed:
                    budget = 0
            if budget == 0 and job.last == ("blend", last_layer):
                self._step(job)  # nothing left but the result: finish it this step

    def _step(self, job: _Sliced) -> bool:
        """One pass of ``job``; False when it completed (the call that only returned the
        result)."""
        started = time.perf_counter()
        job.timer.mark()
        try:
            job.last = next(job.passes)
        except StopIteration as done:
            result = done.value
        else:
            return True
        finally:
            job.busy_s += time.perf_counter() - started
        rid = job.spec.req_id
        del self.sliced[rid]
        wall = time.perf_counter() - job.started
        timing = LoadTiming(job.busy_s, wall, job.steps)
        self.done(job.spec, result, job.target.paged_layers, timing, job.timer.milliseconds())
        self._finished.add(rid)
        return False

    def take_finished(self) -> set[str] | None:
        """Sliced loads completed or cancelled since the last call (``finished_recving``)."""
        if not self._finished:
            return None
        done, self._finished = self._finished, set()
        return done
