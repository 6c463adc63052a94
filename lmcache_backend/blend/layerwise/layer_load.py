"""One request's cached K/V, one layer at a time, into two device buffers per K and V.

A prompt's hits are separate segments (``[L, n, Hkv, D]`` each, in the store's memory); a layer's
rows of all of them, in prompt order with zero rows between them, are one ``torch.cat`` of the
segments' slices of that layer and of zero rows for the gaps. How a layer gets to its buffer
(:data:`LOAD_MODES`):

* ``in place``: the hits live on the compute device (the CPU path, a device tier): that ``cat``
  writes the buffer, one op for K and one for V;
* ``staged`` (the hits in host memory, the blend on a GPU): a loader thread per K and V
  assembles the layer in a page-locked staging buffer (host memory bandwidth, no device launch)
  while the layer before it computes, then copies it to the device in one asynchronous copy on
  a side stream: one host->device copy per K and V and layer;
* ``direct`` (the same case): the loader threads copy each hit's slice from page-locked host
  memory straight into the buffer on the side stream, and zero the gaps there: a copy per hit,
  no host memory pass.

Either way the compute stream waits for a layer's copies with an event (on the device, not the
host) before it reads the layer, and the side stream waits for the compute stream to be done
with the buffer's previous layer before it overwrites it. The compute thread launches nothing per
hit and never waits for the device; it waits for a loader thread only when that thread is behind.
The same code runs on CPU tensors (the tests), with plain memory and no streams.

Shapes: ``T`` tokens of the prompt, ``L`` layers, ``Hkv`` key-value heads, ``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lmcache_backend.storage.segments import SegmentKV

IN_PLACE, STAGED, DIRECT = "in place", "staged", "direct"
#: how a layer's rows reach its buffer (see the module docstring)
LOAD_MODES = (IN_PLACE, STAGED, DIRECT)
#: a span of the prompt's rows: ``(first row, rows, the hit holding them or None for zeros)``
Span = tuple[int, int, SegmentKV | None]


def prompt_spans(hits: Sequence[tuple[int, SegmentKV]], num_tokens: int) -> list[Span]:
    """The prompt's rows ``0..T-1`` as consecutive spans: each hit's, and zero spans between and
    around them (``hits``: non-overlapping ``(start, segment)``, any order)."""
    spans: list[Span] = []
    at = 0
    for start, kv in sorted(hits, key=lambda hit: hit[0]):
        if start > at:
            spans.append((at, start - at, None))
        spans.append((start, kv.num_tokens, kv))
        at = start + kv.num_tokens
    if at < num_tokens:
        spans.append((at, num_tokens - at, None))
    return spans


class LayerLoader:
    """Loads layer after layer of one request's hits into two device buffers per K and V.

    Args:
        hits: ``(start, segment)`` of each hit (non-overlapping, inside the prompt).
        num_layers: ``L``.
        num_tokens: ``T``.
        buffers: two ``(keys, values)`` pairs of ``[T, Hkv, D]`` device tensors; layer ``l``
            goes into ``buffers[l % 2]``.
        host_load: how hits in host memory reach buffers on another device, ``staged`` or
            ``direct``.
        mode: one of :data:`LOAD_MODES` whatever the devices (tests); None: ``in place`` when
            the hits are on the buffers' device, else ``host_load``.
    """

    #: staging buffers per K and V: one being copied to the device, one being filled
    DEPTH = 2

    def __init__(
        self,
        hits: Sequence[tuple[int, SegmentKV]],
        num_layers: int,
        num_tokens: int,
        buffers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        host_load: str = STAGED,
        mode: str | None = None,
    ) -> None:
        if host_load not in (STAGED, DIRECT) or (mode is not None and mode not in LOAD_MODES):
            raise ValueError(f"LayerLoader: unknown load mode {mode or host_load!r}")
        self.buffers = buffers
        self.num_layers = num_layers
        device = buffers[0][0].device
        source = {kv.keys.device for _, kv in hits} or {device}
        # hits in two places (a device tier and host memory): each span is moved on its own
        self._mixed = len(source) > 1
        if mode is None:
            mode = IN_PLACE if source == {device} or self._mixed else host_load
        self.mode = mode
        self._spans = prompt_spans(hits, num_tokens)
        like = hits[0][1].keys if hits else buffers[0][0]
        host = next(iter(source)) if len(source) == 1 else torch.device("cpu")
        longest = max((n for _, n, kv in self._spans if kv is None), default=0)
        self._zeros = torch.zeros((longest, *like.shape[-2:]), dtype=like.dtype, device=host)
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device=device) if self._cuda and mode != IN_PLACE else None
        # one thread each for K and V: each runs its layers in order
        self._pools: list[ThreadPoolExecutor] = []
        self._staging: list[list[torch.Tensor]] = []
        if mode != IN_PLACE:
            self._pools = [
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-load-{which}")
                for which in ("k", "v")
            ]
        if mode == STAGED:
            shape = (num_tokens, *like.shape[-2:])
            pin = self._cuda and host.type == "cpu"
            self._staging = [
                [torch.empty(shape, dtype=like.dtype, pin_memory=pin) for _ in range(self.DEPTH)]
                for _ in range(2)
            ]
        # layer -> its loader jobs (one each for K and V; none when loaded in place)
        self._jobs: dict[int, list[Future]] = {}
        # per K and V and staging buffer: the copy out of it last queued
        self._copied: list[list[torch.cuda.Event | None]] = [[None] * self.DEPTH for _ in range(2)]

    def parts(self, which: int, layer_id: int) -> list[torch.Tensor]:
        """The tensors whose ``cat`` is layer ``layer_id``'s keys (``which`` 0) or values."""
        return [
            self._zeros[:n] if kv is None else (kv.values if which else kv.keys)[layer_id]
            for _, n, kv in self._spans
        ]

    def start(self, layer_id: int) -> None:
        """Begin loading ``layer_id`` into ``buffers[layer_id % 2]``: every use of that buffer
        queued so far on the current stream (its previous layer's) comes first. Staged or
        direct, it runs on the loader threads; in place, the rows are written now."""
        if layer_id in self._jobs or layer_id >= self.num_layers:
            return
        target = self.buffers[layer_id % 2]
        if self.mode == IN_PLACE:
            for which in range(2):
                parts = self.parts(which, layer_id)
                if self._mixed:  # rare: a copy per span that is not on the device yet
                    parts = [part.to(target[which].device) for part in parts]
                torch.cat(parts, out=target[which])
            self._jobs[layer_id] = []
            return
        released = None
        if self._cuda:
            released = torch.cuda.Event()
            released.record(torch.cuda.current_stream(target[0].device))
        load = self._stage if self.mode == STAGED else self._direct
        self._jobs[layer_id] = [
            pool.submit(load, which, layer_id, target[which], released)
            for which, pool in enumerate(self._pools)
        ]

    def _stage(
        self, which: int, layer_id: int, target: torch.Tensor, released: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """On a loader thread: layer ``layer_id``'s K (``which`` 0) or V into its staging
        buffer, then one copy into ``target``; the copy's event (None without CUDA)."""
        slot = layer_id % self.DEPTH
        staging = self._staging[which][slot]
        previous = self._copied[which][slot]
        if previous is not None:  # the copy out of this buffer, two layers ago, is done
            previous.synchronize()
        torch.cat(self.parts(which, layer_id), out=staging)
        if self._side is None:
            target.copy_(staging)
            return None
        with torch.cuda.stream(self._side):
            if released is not None:
                self._side.wait_event(released)
            target.copy_(staging, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._side)
        self._copied[which][slot] = copied
        return copied

    def _direct(
        self, which: int, layer_id: int, target: torch.Tensor, released: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """On a loader thread: each hit's slice of layer ``layer_id``'s K (``which`` 0) or V
        straight into ``target``, the gaps zeroed; the copies' event (None without CUDA)."""

        def copy() -> None:
            for (at, n, kv), part in zip(self._spans, self.parts(which, layer_id)):
                if kv is None:
                    target[at : at + n].zero_()
                else:
                    target[at : at + n].copy_(part, non_blocking=self._cuda)

        if self._side is None:
            copy()
            return None
        with torch.cuda.stream(self._side):
            if released is not None:
                self._side.wait_event(released)
            copy()
            copied = torch.cuda.Event()
            copied.record(self._side)
        return copied

    def wait(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``buffers[layer_id % 2]`` holding layer ``layer_id`` for the current stream's work
        from here on (started if it was not)."""
        self.start(layer_id)
        target = self.buffers[layer_id % 2]
        jobs = self._jobs.pop(layer_id)
        for job in jobs:
            copied = job.result()  # the loader thread, if it is behind; never the device
            if copied is not None:
                torch.cuda.current_stream(target[0].device).wait_event(copied)
        return target

    def close(self) -> None:
        """Let the loader threads finish what they started and stop them; on CUDA the current
        stream then waits (on the device) for the copies they queued, so the buffers' memory
        is not handed out again while a copy into them is pending."""
        for pool in self._pools:
            pool.shutdown(wait=True)
        self._pools = []
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
