"""Eviction and admission policies of the memory tiers: capacity, reported evictions, data
integrity, ghost admission, scan resistance, stats, configuration, and the trace simulation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from segment_cases import entry_bytes, key_of, make_kv, same

from lmcache_backend.bench.load_test import store_policies
from lmcache_backend.config import ConfigError, load_config
from lmcache_backend.storage import FileSegmentIndex, MemoryTier, TieredStore, create_store
from lmcache_backend.storage.policy import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION,
    DEFAULT_EVICTION,
    EVICTION_POLICIES,
)

PAIRS = [(e, a) for e in EVICTION_POLICIES for a in ADMISSION_POLICIES]
ids = [f"{e}-{a}" for e, a in PAIRS]


def _tier(entries: int, eviction: str, admission: str = "always") -> MemoryTier:
    return MemoryTier("cpu", entries * entry_bytes(), "cpu", eviction=eviction, admission=admission)


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "remove"]), st.integers(0, 15), st.integers(1, 4)),
    max_size=120,
)


@pytest.mark.parametrize(("eviction", "admission"), PAIRS, ids=ids)
@settings(max_examples=60, deadline=None)
@given(ops=ops, entries=st.integers(1, 6))
def test_a_key_is_fully_present_or_absent_and_every_departure_is_reported(
    eviction, admission, ops, entries
):
    capacity = entries * entry_bytes()
    tier = MemoryTier("cpu", capacity, "cpu", eviction=eviction, admission=admission)
    left: list[str] = []
    tier.add_evict_listener(left.append)
    held: dict[str, object] = {}  # what the tier must hold: key -> the value first stored
    for op, i, n in ops:
        key = key_of(i)
        kv = make_kv(key, n=n)
        if op == "put":
            stored = tier.put(key, kv)
            if stored and key not in held:
                held[key] = kv
        elif op == "get":
            got = tier.get(key)
            assert (got is None) == (key not in held)
            assert got is None or same(got, held[key]), "an entry came back with other data"
        else:
            assert tier.remove(key) == (key in held)
            if key in held:
                assert left[-1] == key
        for gone in left:  # every reported departure is gone from the model as well
            held.pop(gone, None)
        left.clear()
        assert tier.nbytes <= capacity
        assert set(tier.keys()) == set(held) and len(tier) == len(held)
        assert tier.nbytes == sum(v.nbytes for v in held.values())
        assert all(tier.contains(k) for k in held)


def _scan(tier: MemoryTier) -> list[str]:
    """Four hot keys used across rounds with a few one-offs, then a scan of 30 one-off keys;
    returns the hot keys still held afterwards."""
    hot = [key_of(100 + i) for i in range(4)]
    fresh = iter(range(1000, 2000))
    for _ in range(6):
        for key in hot:
            if tier.get(key) is None:
                tier.put(key, make_kv(key))
        for _ in range(2):
            key = key_of(next(fresh))
            tier.put(key, make_kv(key))
    for _ in range(30):
        key = key_of(next(fresh))
        tier.put(key, make_kv(key))
    return [key for key in hot if tier.contains(key)]


def test_lru_loses_popular_segments_to_a_scan_of_one_off_segments():
    assert _scan(_tier(10, "lru")) == []


@pytest.mark.parametrize(
    ("eviction", "admission"),
    [("s3fifo", "always"), ("lru", "second_sight"), ("s3fifo", "second_sight")],
    ids=["s3fifo", "lru-second_sight", "s3fifo-second_sight"],
)
def test_popular_segments_survive_a_scan_of_one_off_segments(eviction, admission):
    tier = _tier(10, eviction, admission)
    assert len(_scan(tier)) == 4


def test_second_sight_refuses_a_new_segment_once_and_stores_it_when_it_comes_again():
    tier = _tier(2, "lru", "second_sight")
    a, b, c = key_of(1), key_of(2), key_of(3)
    assert tier.put(a, make_kv(a)) and tier.put(b, make_kv(b))  # room left: no admission check
    assert not tier.put(c, make_kv(c)) and not tier.contains(c)
    assert tier.admission_skipped == 1 and set(tier.keys()) == {a, b}
    assert tier.put(c, make_kv(c)) and same(tier.get(c), make_kv(c))  # a ghost hit admits
    assert tier.admission_skipped == 1 and tier.nbytes == 2 * entry_bytes()


def test_s3fifo_admits_a_returning_key_to_its_main_queue():
    tier = _tier(10, "s3fifo")
    keys = [key_of(i) for i in range(12)]
    for key in keys:  # the first two leave the small queue unhit: they are in the ghost list
        tier.put(key, make_kv(key))
    assert not tier.contains(keys[0])
    tier.put(keys[0], make_kv(keys[0]))
    assert keys[0] in tier._policy._main  # noqa: SLF001 - the policy's own state


def test_the_store_counts_refusals_and_keeps_the_index_in_step(tmp_path):
    index = FileSegmentIndex(tmp_path / "index")
    tier = _tier(2, "s3fifo", "second_sight")
    store = TieredStore([tier], index)
    keys = [key_of(i) for i in range(4)]
    for key in keys:
        store.put(key, make_kv(key))
    assert store.stats()["admission_skipped"] == {"cpu": 2}
    assert store.stats()["stored"] == {"cpu": 2}
    assert index.contains_many(keys) == [True, True, False, False]
    for key in keys[2:]:  # seen again: stored, and the evicted ones leave the index
        assert store.put(key, make_kv(key))
    assert store.stats()["evicted"] == {"cpu": 2}
    assert index.contains_many(keys) == [tier.contains(k) for k in keys]
    assert index.contains_many(keys) == [False, False, True, True]


def test_the_store_uses_the_configured_policies_and_names_a_bad_value():
    store = create_store(load_config(local_cpu=True, max_local_cpu_size=0.001))
    tier = store.tiers[0]
    assert (type(tier._policy).__name__, tier._admission.name) == ("S3FIFOPolicy", "second_sight")
    assert (DEFAULT_EVICTION, DEFAULT_ADMISSION) == ("s3fifo", "second_sight")
    extra = {"cache_policy": "LRU", "cache_admission": "always", "segment_index": False}
    store = create_store(load_config(max_local_cpu_size=0.001, extra_config=extra))
    assert (type(store.tiers[0]._policy).__name__, store.tiers[0]._admission.name) == (
        "LRUPolicy",
        "always",
    )
    for key, value in (("cache_policy", "lfu"), ("cache_admission", "sometimes")):
        config = load_config(extra_config={key: value, "segment_index": False})
        with pytest.raises(ConfigError) as err:
            create_store(config)
        message = str(err.value)
        assert "\n" not in message and f"extra_config.{key}" in message and repr(value) in message


def test_the_simulation_is_deterministic_and_the_default_beats_lru():
    keys, segments = store_policies.corpus_segments(200)
    capacity = int(sum(kv.nbytes for kv in segments) * store_policies.CAPACITY_SHARE)
    trace = store_policies.trace(200, 1.0, 400, seed=0)
    lru = store_policies.replay(trace, keys, segments, capacity, "lru", "always")
    default = store_policies.replay(
        trace, keys, segments, capacity, DEFAULT_EVICTION, DEFAULT_ADMISSION
    )
    again = store_policies.replay(
        trace, keys, segments, capacity, DEFAULT_EVICTION, DEFAULT_ADMISSION
    )
    assert default == again
    assert default.hit_late > lru.hit_late and default.written_bytes < lru.written_bytes
    assert default.skipped > 0 and lru.skipped == 0
