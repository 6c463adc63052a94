"""Segments the storage tests store: a test fingerprint, keys, and values derived from their key
(so a mix-up between entries shows)."""

from __future__ import annotations

import logging

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
