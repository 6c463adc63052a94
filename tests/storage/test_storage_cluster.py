"""The shared tier on a real 3-primary Redis Cluster and on a real Sentinel set-up
(``redis_deployments.py``): engines on different nodes share segments, a killed primary costs
only its slots, MOVED/ASK are followed, a failover is found without restarting anything."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from redis_deployments import RedisClusterNodes, SentinelSet
from redis_server import RedisServer
from segment_cases import FP, key_of, make_kv, same, warnings_with

from lmcache_backend.config import load_config
from lmcache_backend.storage import create_lookup, create_store
from lmcache_backend.storage.remote.tier import DEFAULT_PREFIX, RedisTier, redis_key

N = 30  # segments per test, spread over the three primaries


@pytest.fixture
def cluster(tmp_path):
    nodes = RedisClusterNodes(tmp_path / "cluster")
    nodes.start()
    yield nodes
    nodes.stop()


def _store(url: str, tmp_path, name: str, **extra):
    config = load_config(
        env={},
        max_local_cpu_size=0.001,
        remote_url=url,
        extra_config={"remote_retry_base_delay": 0.05, "remote_retry_max_delay": 0.2, **extra},
    )
    return create_store(config, fingerprint=FP, index_dir=str(tmp_path / name))


def _remote(store) -> RedisTier:
    return store.tiers[-1]


def test_two_engines_on_different_cluster_nodes_share_every_segment(cluster, tmp_path):
    # engine a names one node as a plain redis:// URL (the cluster is detected), engine b a
    # cluster URL with another node first, the scheduler of b several nodes in a redis:// URL
    a = _store(cluster.node_url(0), tmp_path, "a")
    b = _store(f"redis://{cluster.addresses[1]}?cluster=true", tmp_path, "b")
    lookup = create_lookup(
        load_config(env={}, remote_url=f"redis://{cluster.addresses[2]},{cluster.addresses[0]}"),
        index_dir=str(tmp_path / "b"),
    )
    assert _remote(a).mode == _remote(b).mode == "cluster"
    keys = [key_of(i) for i in range(N)]
    for key in keys:
        assert a.put(key, make_kv(key))
    owners = {cluster.owner(redis_key(DEFAULT_PREFIX, k)) for k in keys}
    assert owners == {0, 1, 2}, "the segments should spread over the three primaries"
    assert b.lookup(keys) == [True] * N
    assert lookup.contains_many(keys + [key_of(999)]) == [True] * N + [False]
    assert all(same(b.get(k), make_kv(k)) for k in keys)
    assert b.stats()["hits"]["redis"] == N
    assert set(b.stats()["remote_nodes"]) == set(cluster.addresses)
    a.close(), b.close(), lookup.close()


def test_a_killed_primary_costs_only_its_slots(cluster, tmp_path, caplog):
    a = _store(cluster.url, tmp_path, "a", segment_index=False)
    b = _store(cluster.url, tmp_path, "b", segment_index=False)
    keys = [key_of(100 + i) for i in range(N)]
    for key in keys:
        assert a.put(key, make_kv(key))
    dead = cluster.owner(redis_key(DEFAULT_PREFIX, keys[0]))
    on_dead = [cluster.owner(redis_key(DEFAULT_PREFIX, k)) == dead for k in keys]
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        cluster.kill(dead)
        started = time.monotonic()
        for _ in range(3):  # repeated lookups and loads: no error, the rest still found
            assert b.lookup(keys) == [not d for d in on_dead]
            got = [b.get(k) for k in keys]
            assert [g is not None for g in got] == [not d for d in on_dead]
            assert all(same(g, make_kv(k)) for g, k in zip(got, keys, strict=True) if g)
        # new segments on the living primaries are still stored and found
        fresh = [key_of(200 + i) for i in range(N)]
        stored = [b.put(k, make_kv(k)) for k in fresh]
        assert all(stored)  # the CPU tier always stores
        alive = [cluster.owner(redis_key(DEFAULT_PREFIX, k)) != dead for k in fresh]
        assert _remote(a).contains_many(fresh) == alive
        elapsed = time.monotonic() - started
    assert elapsed < 5.0, f"a dead primary slowed requests down: {elapsed:.1f} s"
    name = cluster.addresses[dead]
    unreachable = warnings_with(caplog, "unreachable")
    assert unreachable and all(name in r.getMessage() for r in unreachable)
    nodes = b.stats()["remote_nodes"]
    assert nodes[name]["up"] == 0 and nodes[name]["outages"] == 1
    assert all(n["up"] == 1 for addr, n in nodes.items() if addr != name)

    cluster.restart(dead)  # back, empty: its slots answer again
    deadline = time.monotonic() + 20
    while not _remote(b).available and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.stats()["remote_nodes"][name] == {
        "up": 1,
        "outages": 1,
        "reconnects": 1,
        "refused": 0,
    }
    assert b.put(keys[0], make_kv(keys[0])) and _remote(a).contains(keys[0])
    a.close(), b.close()


def test_moved_and_ask_redirections_are_followed(cluster):
    """A slot moved behind the client's back (MOVED), and one being migrated (ASK)."""
    tier = RedisTier(cluster.url, retry_base_delay=0.05, retry_max_delay=0.2)
    reader = RedisTier(cluster.url, retry_base_delay=0.05, retry_max_delay=0.2)
    moved, asked = key_of(300), key_of(301)
    assert tier.put(moved, make_kv(moved)) and tier.put(asked, make_kv(asked))
    assert reader.contains_many([moved, asked]) == [True, True]  # reader learns the slot map

    def migrate(key: str, finish: bool) -> None:
        rkey = redis_key(DEFAULT_PREFIX, key)
        src = cluster.owner(rkey)
        dst = (src + 1) % 3
        source, target = cluster.servers[src].client(), cluster.servers[dst].client()
        slot = int(source.cluster("keyslot", rkey))
        dst_id = target.cluster("myid")
        src_id = source.cluster("myid")
        target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        source.execute_command("MIGRATE", "127.0.0.1", cluster.servers[dst].port, rkey, 0, 5000)
        if finish:
            for client in (target, source, *[s.client() for s in cluster.servers]):
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    migrate(moved, finish=True)  # the reader still maps the slot to the old owner: MOVED
    migrate(asked, finish=False)  # the old owner answers ASK for the migrated key
    assert reader.contains_many([moved, asked]) == [True, True]
    assert same(reader.get(moved), make_kv(moved)) and same(reader.get(asked), make_kv(asked))
    tier.close(), reader.close()


def test_segment_entries_of_all_ranks_share_a_slot(cluster, tmp_path):
    """The hash tag: one segment's entries under every tensor-parallel rank's prefix live on
    one primary, so a dead primary never leaves a segment present for some ranks only."""
    key = key_of(400)
    ranks = [f"{DEFAULT_PREFIX}tp{r}of4:" for r in range(4)]
    assert len({cluster.owner(redis_key(p, key)) for p in ranks}) == 1
    keys = [key_of(401 + i) for i in range(N)]
    assert len({cluster.owner(redis_key(ranks[0], k)) for k in keys}) == 3


def test_unreachable_cluster_at_start_comes_up_later(tmp_path, caplog):
    nodes = RedisClusterNodes(tmp_path / "late")
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        store = _store(nodes.url, tmp_path, "a", segment_index=False)
        key = key_of(500)
        assert store.put(key, make_kv(key)) and same(store.get(key), make_kv(key))
    assert len(warnings_with(caplog, "unreachable")) == 1
    nodes.start()
    try:
        remote = _remote(store)
        deadline = time.monotonic() + 20
        while not (remote.available and remote.put(key, make_kv(key))):
            assert time.monotonic() < deadline, "did not connect once the cluster came up"
            time.sleep(0.05)
        assert remote.contains(key)
    finally:
        store.close()
        nodes.stop()


def test_sentinel_failover_is_found_without_restarting(tmp_path, caplog):
    sentinels = SentinelSet(tmp_path / "sentinel")
    sentinels.start()
    try:
        # LMCache's form, with a sentinel that is down listed first
        dead = RedisServer()
        url = sentinels.url.replace("://", f"://127.0.0.1:{dead.port},")
        a, b = _store(url, tmp_path, "a"), _store(url, tmp_path, "b")
        assert _remote(a).mode == "sentinel"
        keys = [key_of(600 + i) for i in range(10)]
        for key in keys:
            assert a.put(key, make_kv(key))
        sentinels.master.client().wait(1, 2000)  # the replica holds them
        with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
            sentinels.kill_master_and_wait_failover()
            deadline = time.monotonic() + 20
            while b.lookup(keys) != [True] * len(keys):  # requests go on meanwhile: misses
                assert time.monotonic() < deadline, "reuse did not resume after the failover"
                time.sleep(0.05)
        assert all(same(b.get(k), make_kv(k)) for k in keys)
        fresh = key_of(700)
        assert a.lookup([fresh]) == [False]
        deadline = time.monotonic() + 20
        while not (_remote(a).available and _remote(a).put(fresh, make_kv(fresh))):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sentinels.replica.client().exists(redis_key(DEFAULT_PREFIX, fresh)) == 1
        for store in (a, b):  # an outage seen during the failover has ended
            node = store.stats()["remote_nodes"]["sentinel/mymaster"]
            assert node["up"] == 1 and node["reconnects"] == node["outages"]
        a.close(), b.close()
    finally:
        sentinels.stop()


def test_sentinel_without_such_master_warns_with_the_name(tmp_path, caplog):
    sentinels = SentinelSet(tmp_path / "sentinel")
    sentinels.start()
    try:
        url = sentinels.url.rsplit("/", 1)[0]  # no master name: LMCache's default
        with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
            store = _store(url, tmp_path, "a", segment_index=False)
        warned = warnings_with(caplog, "unreachable")
        assert len(warned) == 1 and "redismaster" in warned[0].getMessage()
        store.close()
        store = _store(url, tmp_path, "b", remote_sentinel_master="mymaster")
        key = key_of(800)
        assert store.put(key, make_kv(key)) and _remote(store).contains(key)
        store.close()
    finally:
        sentinels.stop()


def test_refused_writes_are_counted_per_node(tmp_path, caplog):
    server = RedisServer(["--maxmemory-policy", "noeviction"])
    server.start()
    try:
        admin = server.client()
        admin.set("ballast", b"x" * 2_000_000)
        admin.config_set("maxmemory", "1mb")  # past maxmemory: every write is OOM
        tier = RedisTier(server.url)
        with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
            for i in range(5):
                assert tier.put(key_of(900 + i), make_kv(key_of(900 + i))) is False
        name = f"127.0.0.1:{server.port}"
        assert tier.node_stats()[name]["refused"] == 5
        assert tier.node_stats()[name]["up"] == 1  # refusing is not unreachable
        assert len(warnings_with(caplog, "OutOfMemoryError")) == 1  # not one per write
        tier.close()
    finally:
        server.stop()


def test_redis_errors_of_the_client_library_never_escape(cluster):
    """Whatever redis-py raises while a primary dies mid-pipeline is a miss, not an error."""
    tier = RedisTier(cluster.url, retry_base_delay=0.05)
    keys = [key_of(1000 + i) for i in range(N)]
    for key in keys:
        tier.put(key, make_kv(key))
    cluster.kill(1)
    try:
        answers = tier.contains_many(keys)
    except redis.exceptions.RedisError as exc:  # pragma: no cover - the failure shown
        pytest.fail(f"{type(exc).__name__} escaped the tier: {exc}")
    assert answers.count(True) < N
    tier.close()
