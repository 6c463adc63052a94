"""A value that fails verification never blocks the genuine one, on every tier: it is refused,
counted and removed, and the next store of the segment puts the genuine value in its place
(real ``redis-server`` and a real 3-primary Redis Cluster)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import pytest
import torch
from segment_cases import FP, FP_HEX, LAYOUT, OTHER_FP, key_of, make_kv, same, warnings_with

from lmcache_backend.storage import DiskTier, ExpectedLayout, MemoryTier, TieredStore, serde
from lmcache_backend.storage.remote.auth import MAGIC, TAG_BYTES, EntryAuth, is_sealed
from lmcache_backend.storage.remote.shared_copy import SharedCopyCheck
from lmcache_backend.storage.remote.tier import DEFAULT_PREFIX, RedisTier, redis_key
from lmcache_backend.storage.segments import SegmentKV

SECRET = b"refused-values-secret-0123456789"
N = 3  # tokens of every key_of() segment

#: ``bad(key, raw, auth) -> bytes``: what is written over the genuine stored value ``raw``
Bad = Callable[[str, bytes, EntryAuth | None], bytes]


def _entry(key: str, kv: SegmentKV, fp: str = FP_HEX) -> bytes:
    return serde.encode(key, kv, fp, LAYOUT)


def _sealed(auth: EntryAuth | None, key: str, entry: bytes) -> bytes:
    return entry if auth is None else auth.seal(key, entry)


def _zeros(key: str) -> SegmentKV:
    real = make_kv(key)
    return SegmentKV(torch.zeros_like(real.keys), torch.zeros_like(real.values), 0)


def _flip(raw: bytes, pos: int, header: bool = False) -> bytes:
    """``raw`` with one bit changed at ``pos``, or (``header``) in the JSON header of the entry
    inside it (after a sealed value's magic and tag, and the header's 8-byte length)."""
    if header:
        pos = (len(MAGIC) + TAG_BYTES if is_sealed(raw) else 0) + 8 + 2
    return raw[:pos] + bytes([raw[pos] ^ 1]) + raw[pos + 1 :]


# forged: what a writer without the shared secret can store (only refused with a secret)
FORGED: dict[str, Bad] = {
    "no tag": lambda key, raw, auth: _entry(key, _zeros(key)),
    "another secret's tag": lambda key, raw, auth: EntryAuth(b"x" * 32).seal(
        key, _entry(key, _zeros(key))
    ),
    "a genuine value moved from another key": lambda key, raw, auth: _sealed(
        auth, key_of(900), _entry(key_of(900), make_kv(key_of(900)))
    ),
}
# corrupted: damaged bytes, or values no writer of this model and segment produces
CORRUPTED: dict[str, Bad] = {
    "truncated": lambda key, raw, auth: raw[: len(raw) - 7],
    "trailing bytes": lambda key, raw, auth: raw + b"\0" * 16,
    "a header byte changed": lambda key, raw, auth: _flip(raw, len(raw) // 2, header=True),
    "one bit flipped inside": lambda key, raw, auth: _flip(raw, len(raw) - 3),
    "garbage": lambda key, raw, auth: b"\x80\x04not a segment",
    "another model's": lambda key, raw, auth: _sealed(
        auth, key, serde.encode(key, make_kv(key), serde.fingerprint_hex(OTHER_FP), LAYOUT)
    ),
    "another length": lambda key, raw, auth: _sealed(auth, key, _entry(key, make_kv(key, n=5))),
}


@pytest.fixture(scope="module")
def cluster(redis_cluster):
    return redis_cluster


def _redis(url: str, auth: EntryAuth | None) -> RedisTier:
    return RedisTier(
        url,
        FP_HEX,
        ExpectedLayout.from_fingerprint(FP),
        auth=auth,
        retry_base_delay=0.05,
        retry_max_delay=0.2,
    )


class _RedisValues:
    """Reads and overwrites a tier's stored values as another writer of the servers would."""

    def __init__(self, client) -> None:
        self.client = client

    def read(self, key: str) -> bytes | None:
        return self.client.get(redis_key(DEFAULT_PREFIX, key))

    def write(self, key: str, value: bytes) -> None:
        self.client.set(redis_key(DEFAULT_PREFIX, key), value)


def _check_refused_then_replaced(tier, values, key: str, bad: Bad, auth, caplog) -> None:
    genuine = make_kv(key)
    assert tier.put(key, genuine)
    values.write(key, bad(key, values.read(key), auth))
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert tier.get(key, N) is None
    assert warnings_with(caplog, "refusing segment")
    assert tier.refused == 1 and values.read(key) is None, "refused, counted and removed"
    assert tier.put(key, genuine), "the genuine value is stored where the refused one was"
    assert tier.replaced == 1
    assert same(tier.get(key, N), genuine)
    if auth is not None:  # what other engines of the fleet read is the genuine value
        assert same(serde.decode(auth.open(key, values.read(key)), key, FP_HEX), genuine)


@pytest.mark.parametrize("kind", [*FORGED, *CORRUPTED])
def test_redis_with_a_secret_replaces_every_refused_value(server, caplog, kind) -> None:
    auth = EntryAuth(SECRET)
    tier = _redis(server.url, auth)
    bad = {**FORGED, **CORRUPTED}[kind]
    _check_refused_then_replaced(tier, _RedisValues(server.client()), key_of(1), bad, auth, caplog)
    tier.close()


@pytest.mark.parametrize("kind", list(CORRUPTED))
def test_redis_without_a_secret_replaces_every_corrupted_value(server, caplog, kind) -> None:
    tier = _redis(server.url, None)
    values = _RedisValues(server.client())
    _check_refused_then_replaced(tier, values, key_of(2), CORRUPTED[kind], None, caplog)
    tier.close()


@pytest.mark.parametrize("kind", [*FORGED, *CORRUPTED])
def test_a_redis_cluster_replaces_every_refused_value(cluster, caplog, kind) -> None:
    from redis.cluster import RedisCluster

    auth = EntryAuth(SECRET)
    tier = _redis(cluster.url, auth)
    client = RedisCluster.from_url(cluster.node_url(0))
    bad = {**FORGED, **CORRUPTED}[kind]
    _check_refused_then_replaced(tier, _RedisValues(client), key_of(3), bad, auth, caplog)
    client.close()
    tier.close()


class _DiskFiles:
    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier

    def read(self, key: str) -> bytes | None:
        path = self.tier._path(key)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as fh:
            return fh.read()

    def write(self, key: str, value: bytes) -> None:
        with open(self.tier._path(key), "wb") as fh:
            fh.write(value)


@pytest.mark.parametrize("kind", list(CORRUPTED))
def test_disk_replaces_every_corrupted_file(tmp_path, caplog, kind) -> None:
    tier = DiskTier(tmp_path / "disk", 1 << 20, FP_HEX, LAYOUT)
    _check_refused_then_replaced(tier, _DiskFiles(tier), key_of(4), CORRUPTED[kind], None, caplog)


def test_memory_refuses_a_value_of_another_length(caplog) -> None:
    tier = MemoryTier("cpu", 1 << 20, name="cpu")
    key = key_of(5)
    assert tier.put(key, make_kv(key, n=5))
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert tier.get(key, N) is None
    assert warnings_with(caplog, "refusing segment") and not tier.contains(key)
    assert tier.refused == 1
    assert tier.put(key, make_kv(key)) and tier.replaced == 1
    assert same(tier.get(key, N), make_kv(key))


def test_a_refused_value_is_not_copied_into_faster_tiers(server) -> None:
    cpu = MemoryTier("cpu", 1 << 20, name="cpu")
    store = TieredStore([cpu, _redis(server.url, None)])
    key = key_of(6)
    _RedisValues(server.client()).write(key, _entry(key, make_kv(key, n=5)))
    assert store.get(key, N) is None and not cpu.contains(key)
    assert store.stats()["refused"] == {"cpu": 0, "redis": 1}
    store.close()


# -- the shared copy of segments an engine serves from its own memory --------------------------


def _engine_store(url: str, interval_s: float = 0.0) -> TieredStore:
    """An engine's store: a CPU tier in front of the shared tier, with the secret."""
    store = TieredStore([MemoryTier("cpu", 1 << 22, name="cpu"), _redis(url, EntryAuth(SECRET))])
    store.shared_copies = SharedCopyCheck(store.remote_tiers, store._local_value, interval_s)
    return store


#: what changes a value's length or first bytes; a change inside that keeps both is refused by
#: the next engine that reads the value (the tests above), not by the one that holds it
VISIBLE_TO_THE_HOLDER = [k for k in CORRUPTED if k != "one bit flipped inside"]


def _six_forged_six_corrupted(values, auth: EntryAuth) -> list[str]:
    bad = [*FORGED.values(), *FORGED.values(), *(CORRUPTED[k] for k in VISIBLE_TO_THE_HOLDER)]
    assert len(bad) == 12
    keys = [key_of(100 + 10 * i) for i in range(len(bad))]
    for key, damage in zip(keys, bad):
        values.write(key, damage(key, values.read(key), auth))
    return keys


@pytest.mark.parametrize("deployment", ["one server", "cluster"])
def test_copies_refused_behind_an_engines_back_are_replaced_at_its_next_hit(
    request, deployment
) -> None:
    """An engine holds its segments in memory; another writer overwrites their Redis copies
    (6 forged, 6 corrupted). The engine's next hit of each finds it and puts its own back."""
    if deployment == "cluster":
        from redis.cluster import RedisCluster

        nodes = request.getfixturevalue("cluster")
        url, client = nodes.url, RedisCluster.from_url(nodes.node_url(0))
    else:
        srv = request.getfixturevalue("server")
        url, client = srv.url, srv.client()
    auth, values = EntryAuth(SECRET), _RedisValues(client)
    store = _engine_store(url)
    keys = [key_of(100 + 10 * i) for i in range(12)]
    for key in keys:
        assert store.put(key, make_kv(key))
    assert _six_forged_six_corrupted(values, auth) == keys
    for key in keys:
        assert same(store.get(key, N), make_kv(key)), "served from memory, as before"
    assert store.shared_copies.wait_idle()
    for key in keys:
        entry = auth.open(key, values.read(key))
        assert same(serde.decode(entry, key, FP_HEX, LAYOUT), make_kv(key))
    stats = store.stats()
    assert stats["refused"]["redis"] == 12 and stats["replaced"]["redis"] == 12
    assert stats["hits"] == {"cpu": 12, "redis": 0}
    client.close()
    store.close()


def _calls(client, command: str) -> int:
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def test_an_unchanged_copy_costs_one_small_read_a_minute(server) -> None:
    """The copy this engine wrote is recognised by its length and first bytes (one small
    script), never read whole, and checked again only after the interval."""
    client = server.client()
    store = _engine_store(server.url, interval_s=60.0)
    key = key_of(7)
    assert store.put(key, make_kv(key))
    gets, scripts = _calls(client, "get"), _calls(client, "eval")
    for _ in range(3):
        assert same(store.get(key, N), make_kv(key))
    assert store.shared_copies.wait_idle()
    assert _calls(client, "eval") == scripts + 1 and _calls(client, "get") == gets
    assert store.stats()["refused"]["redis"] == 0
    store.close()


def test_a_copy_another_engine_stored_is_verified_once_then_recognised(server) -> None:
    """A valid value written by another engine (other bytes) is read whole once, verified and
    kept; from then on its first bytes are known."""
    other = _redis(server.url, EntryAuth(SECRET))
    store = _engine_store(server.url)
    key = key_of(8)
    assert other.put(key, make_kv(key))
    store.tiers[0].put(key, SegmentKV(make_kv(key).keys * 1.001, make_kv(key).values, 0))
    client = server.client()
    gets = _calls(client, "get")
    store.get(key, N)
    assert store.shared_copies.wait_idle()
    assert _calls(client, "get") == gets + 1, "read whole once"
    assert same(other.get(key, N), make_kv(key)), "another engine's valid value is kept"
    store.get(key, N)
    assert store.shared_copies.wait_idle()
    assert _calls(client, "get") == gets + 2, "other's own get above; none from the check"
    assert store.stats()["refused"]["redis"] == 0
    other.close()
    store.close()
