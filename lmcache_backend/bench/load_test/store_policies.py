"""Replay RAG request traces through the real segment store under each eviction/admission policy.

The workload is the load benchmark's (:mod:`lmcache_backend.bench.load_test.workload`): a corpus of
``D`` chunks of ~200 tokens with Zipf popularity (rank ``r`` has weight ``1 / r^s``), each request
taking ``k = 5`` distinct chunks. The store (a :class:`~lmcache_backend.storage.tiered.TieredStore`
over one CPU :class:`~lmcache_backend.storage.memory.MemoryTier`) holds a third of the corpus'
bytes. Each request looks its chunks up (a hit is a chunk the store lists, which is what the
connector would claim), loads the hits, then stores the chunks it lacked, as the worker does;
the store's admission policy may refuse them. Segments are real :class:`SegmentKV` with tiny
tensors (``[1, tokens, 1, 1]`` float16), so the tier's byte accounting is the real one.

Reported per workload and policy, averaged over seeds: the segment hit rate over requests
200-400 and over the last 200 (a rate that decays shows there), segments written, evictions and
admission refusals per request. ``top-C`` is the hit rate of a store holding exactly the most
popular chunks that fit (the best a static choice does). Deterministic: no clock, seeded draws.

    python -m lmcache_backend.bench.load_test.store_policies [--requests 1000] [--seeds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from lmcache_backend.bench.load_test.workload import ZipfSampler
from lmcache_backend.storage.memory import MemoryTier
from lmcache_backend.storage.segments import SegmentKV
from lmcache_backend.storage.tiered import TieredStore

#: (eviction, admission) pairs compared
POLICIES: tuple[tuple[str, str], ...] = (
    ("lru", "always"),
    ("lru", "second_sight"),
    ("s3fifo", "always"),
    ("s3fifo", "second_sight"),
)
#: (corpus chunks D, Zipf exponent s)
WORKLOADS: tuple[tuple[int, float], ...] = (
    (200, 1.0),
    (1000, 1.0),
    (200, 0.8),
    (1000, 0.8),
    (200, 1.2),
    (1000, 1.2),
)
CHUNKS_PER_REQUEST = 5
CAPACITY_SHARE = 1 / 3


@dataclass
class RunResult:
    """One replay: hit rates (fractions) and store activity."""

    hit_early: float  # requests 200-400
    hit_late: float  # the last 200
    written: int  # segments stored
    written_bytes: int
    evicted: int
    skipped: int  # admission refusals


def corpus_segments(num_chunks: int) -> tuple[list[str], list[SegmentKV]]:
    """Keys and tiny segments of ``num_chunks`` chunks of 180-220 tokens (fixed per chunk)."""
    keys, segments = [], []
    for i in range(num_chunks):
        keys.append(hashlib.sha256(f"store-policies-chunk-{i}".encode()).hexdigest())
        tokens = random.Random(f"chunk-size-{i}").randint(180, 220)
        kv = torch.zeros(1, tokens, 1, 1, dtype=torch.float16)
        segments.append(SegmentKV(kv, kv.clone(), 0))
    return keys, segments


def trace(num_chunks: int, zipf: float, requests: int, seed: int) -> list[list[int]]:
    """Chunk indices (0 = most popular) of each request, drawn as the load benchmark does."""
    sampler = ZipfSampler(num_chunks, zipf, random.Random(f"store-policies-{seed}"))
    return [sampler.draw(CHUNKS_PER_REQUEST) for _ in range(requests)]


def _windows(requests: int) -> tuple[range, range]:
    return range(200, min(400, requests)), range(max(requests - 200, 0), requests)


def replay(
    requests: Sequence[Sequence[int]],
    keys: Sequence[str],
    segments: Sequence[SegmentKV],
    capacity: int,
    eviction: str,
    admission: str,
) -> RunResult:
    """Replay ``requests`` through a fresh store with the given policies."""
    tier = MemoryTier(
        "cpu", capacity, "cpu", copy_on_get=False, eviction=eviction, admission=admission
    )
    store = TieredStore([tier])
    hits_per_request = []
    for chunk_ids in requests:
        wanted = [keys[i] for i in chunk_ids]
        found = store.lookup(wanted)
        hits_per_request.append(sum(found))
        for key, hit in zip(wanted, found, strict=True):  # the blend loads every hit first
            if hit and store.get(key) is None:
                raise AssertionError(f"listed segment {key} could not be loaded")
        for i, key, hit in zip(chunk_ids, wanted, found, strict=True):  # then the save
            if not hit:
                store.put(key, segments[i])
        if tier.nbytes > capacity:
            raise AssertionError("the tier holds more than its capacity")
    early, late = _windows(len(requests))
    stats = store.stats()
    per = CHUNKS_PER_REQUEST
    return RunResult(
        hit_early=sum(hits_per_request[i] for i in early) / (per * max(len(early), 1)),
        hit_late=sum(hits_per_request[i] for i in late) / (per * max(len(late), 1)),
        written=stats["stored"]["cpu"],
        written_bytes=stats["stored_bytes"]["cpu"],
        evicted=stats["evicted"]["cpu"],
        skipped=stats["admission_skipped"]["cpu"],
    )


def static_top(requests: Sequence[Sequence[int]], segments: Sequence[SegmentKV], capacity: int):
    """Hit rates (early, late) of a store holding the most popular chunks that fit."""
    held, used = set(), 0
    for i, kv in enumerate(segments):
        if used + kv.nbytes > capacity:
            break
        held.add(i)
        used += kv.nbytes
    early, late = _windows(len(requests))

    def rate(window: range) -> float:
        hits = sum(1 for j in window for i in requests[j] if i in held)
        return hits / (CHUNKS_PER_REQUEST * max(len(window), 1))

    return rate(early), rate(late)


def run(requests: int, seeds: int) -> list[dict]:
    """Every workload x policy, averaged over ``seeds``; one row per pair."""
    rows = []
    for num_chunks, zipf in WORKLOADS:
        keys, segments = corpus_segments(num_chunks)
        capacity = int(sum(kv.nbytes for kv in segments) * CAPACITY_SHARE)
        traces = [trace(num_chunks, zipf, requests, seed) for seed in range(seeds)]
        tops = [static_top(t, segments, capacity) for t in traces]
        for eviction, admission in POLICIES:
            results = [replay(t, keys, segments, capacity, eviction, admission) for t in traces]
            rows.append(
                {
                    "chunks": num_chunks,
                    "zipf": zipf,
                    "eviction": eviction,
                    "admission": admission,
                    "top_early": statistics.mean(e for e, _ in tops),
                    "top_late": statistics.mean(late for _, late in tops),
                    **{
                        field: statistics.mean(getattr(r, field) for r in results)
                        for field in asdict(results[0])
                    },
                    "requests": requests,
                    "seeds": seeds,
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    out = [
        "| D | s | eviction | admission | hit 200-400 | hit last 200 | top-C | "
        "written/req | evictions/req | refused/req |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["requests"]
        out.append(
            f"| {r['chunks']} | {r['zipf']} | {r['eviction']} | {r['admission']} "
            f"| {100 * r['hit_early']:.1f}% | {100 * r['hit_late']:.1f}% "
            f"| {100 * r['top_late']:.1f}% | {r['written'] / n:.2f} | {r['evicted'] / n:.2f} "
            f"| {r['skipped'] / n:.2f} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per trace")
    parser.add_argument("--seeds", type=int, default=5, help="traces per workload")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.requests < 400:
        parser.error("--requests must be at least 400 (the windows are 200-400 and the last 200)")
    rows = run(args.requests, args.seeds)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
