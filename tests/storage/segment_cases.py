"""Segments the storage tests store: a test fingerprint, keys, and values derived from their key
(so a mix-up between entries shows)."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage import ExpectedLayout, serde
from lmcache_backend.storage.segments import SegmentKV, segment_key

FP = ModelFingerprint("TestLM", 2, 4, 2, 8, "theta=10000.0,neox=True", "float32", "w0")
OTHER_FP = ModelFingerprint("TestLM", 2, 4, 2, 8, "theta=10000.0,neox=True", "float32", "w1")
FP_HEX = serde.fingerprint_hex(FP)
LAYOUT = ExpectedLayout.from_fingerprint(FP)


def key_of(i: int, fp: ModelFingerprint = FP) -> str:
    return segment_key(fp, [i, i + 1, i + 2])


def make_kv(key: str, n: int = 3, dtype: torch.dtype = torch.float32) -> SegmentKV:
    """A segment whose content is derived from ``key``: ``[2, n, 2, 8]``, so a mix-up shows."""
    g = torch.Generator().manual_seed(int(key[:12], 16))
    keys = torch.randn(2, n, 2, 8, generator=g).to(dtype)
    values = torch.randn(2, n, 2, 8, generator=g).to(dtype)
    return SegmentKV(keys, values, start_position=int(key[:4], 16) % 1000)


def same(a: SegmentKV | None, b: SegmentKV) -> bool:
    return (
        a is not None
        and a.start_position == b.start_position
        and a.keys.dtype == b.keys.dtype
        and torch.equal(a.keys.cpu(), b.keys.cpu())
        and torch.equal(a.values.cpu(), b.values.cpu())
    )


def entry_bytes(n: int = 3) -> int:
    return 2 * 2 * n * 2 * 8 * 4  # keys + values, fp32


def warnings_with(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def soak(stores: list, seconds: float, threads: int = 4, pool: int = 24) -> tuple[int, int, int]:
    """Threads put/get overlapping segments, each operation on one of ``stores`` (engines
    sharing a tier); returns (hits, puts, mismatches)."""
    keys = [key_of(1000 + i) for i in range(pool)]
    expected = {k: make_kv(k, n=1 + int(k[-2:], 16) % 6) for k in keys}
    counts = {"hits": 0, "puts": 0, "bad": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []
    deadline = time.monotonic() + seconds

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < deadline:
                store = rng.choice(stores)
                key = rng.choice(keys)
                if rng.random() < 0.4:
                    kv = expected[key]
                    # a fresh tensor each time, as an engine would store it
                    store.put(key, SegmentKV(kv.keys.clone(), kv.values.clone(), kv.start_position))
                    with lock:
                        counts["puts"] += 1
                else:
                    got = store.get(key)
                    if got is not None:
                        with lock:
                            counts["hits"] += 1
                            counts["bad"] += not same(got, expected[key])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(s,)) for s in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    return counts["hits"], counts["puts"], counts["bad"]
