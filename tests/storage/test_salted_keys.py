"""``cache_salt`` in the segment key: one namespace per salt, the unsalted one unchanged, and the
blender's lookups and the saver's stores each in the request's own namespace."""

from __future__ import annotations

import hashlib
import struct

import torch
from segment_cases import FP

from lmcache_backend.blend.segments.retriever import SPTBlendRetriever
from lmcache_backend.blend.segments.segment_cache import SegmentCache
from lmcache_backend.storage import MemoryTier
from lmcache_backend.storage.segments import key_seed, segment_key, segment_keys

TOKENS = [5, 6, 7, 8, 9]
SEP = [0]


def test_unsalted_keys_are_unchanged() -> None:
    """No salt (or vLLM's empty one) keys as before: entries stored by earlier releases and by
    unsalted requests stay shared."""
    old = hashlib.sha256(FP.digest())
    old.update(struct.pack("<5q", *TOKENS))
    assert segment_key(FP, TOKENS) == segment_key(FP, TOKENS, None) == old.hexdigest()
    assert segment_key(FP, TOKENS, "") == old.hexdigest()


def test_every_salt_is_its_own_namespace() -> None:
    salts = [None, "tenant-A", "tenant-B", "tenant-A ", "\ud800", "x" * 128]
    keys = {segment_key(FP, TOKENS, s) for s in salts}
    assert len(keys) == len(salts)
    assert all(len(key_seed(FP, s)) == 32 for s in salts)  # token bytes never shift a seed
    spans = [(0, 2), (2, 5), (1, 4)]
    for salt in salts:
        expected = [segment_key(FP, TOKENS[a:b], salt) for a, b in spans]
        assert segment_keys(FP, TOKENS, spans, salt) == expected


def _prompt() -> list[int]:
    return [1, 2, 3, *SEP, 4, 5, 6, *SEP, 7, 8]


def _store_prompt(cache: SegmentCache, tokens: list[int]) -> int:
    n = len(tokens)
    keys = [torch.randn(n, 2, 8) for _ in range(2)]
    values = [torch.randn(n, 2, 8) for _ in range(2)]
    return cache.store_segments(tokens, keys, values)


def test_lookups_and_stores_stay_in_their_salt() -> None:
    store = MemoryTier("cpu", 1 << 20, name="cpu")
    cache = SegmentCache(store, FP, SEP)
    tokens = _prompt()
    assert _store_prompt(cache.salted("tenant-A"), tokens) == 2
    retriever = SPTBlendRetriever(SEP, store, FP)
    hits = {
        salt: int(retriever.new_request(tokens, None, cache_salt=salt).valid_mask.sum())
        for salt in ("tenant-A", "tenant-B", None)
    }
    assert hits == {"tenant-A": 8, "tenant-B": 0, None: 0}
    # tenant B stores its own computation of the same segments beside tenant A's
    assert _store_prompt(cache.salted("tenant-B"), tokens) == 2
    assert len(store.keys()) == 4
    assert cache.salted(None) is cache and cache.salted("") is cache


def test_the_vllm_saver_stores_under_the_requests_salt() -> None:
    from lmcache_backend.integration.vllm.metadata import SaveSpec
    from lmcache_backend.integration.vllm.worker_side.saves import SegmentSaver

    store = MemoryTier("cpu", 1 << 20, name="cpu")
    cache = SegmentCache(store, FP, SEP)

    def read_rows(slots):  # the paged cache's rows at these slots, per layer
        n = len(slots)
        return [torch.randn(n, 2, 8) for _ in range(2)], [torch.randn(n, 2, 8) for _ in range(2)]

    saver = SegmentSaver(cache, read_rows, block_size=4)
    tokens = _prompt()
    assert saver.save(SaveSpec("r1", tokens, [0, 1, 2], cache_salt="tenant-A")) == 2
    salted = cache.salted("tenant-A")
    assert all(held for _, held in salted.cached(tokens))
    assert not any(held for _, held in cache.cached(tokens)), "nothing stored unsalted"
    # the same prompt unsalted is stored beside it, not found as already held
    assert saver.save(SaveSpec("r2", tokens, [0, 1, 2])) == 2
