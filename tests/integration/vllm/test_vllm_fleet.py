"""A fleet of ``lmcache-backend serve`` engines on a real Redis Cluster and on Sentinel, with
the shared-tier secret, over HTTP: what a bad value in the shared tier costs, a killed primary
and a failover.

Engines A and B share a 3-primary cluster (A names one node as a plain ``redis://`` URL, B a
``redis+cluster://`` URL of two others). Entries A stored are overwritten in Redis, 6 forged (no
tag, another secret's tag, a genuine value moved from another key) and 6 corrupted; B, which never
held them, serves the documents again: it refuses each bad value, computes the segment, and its
genuine value is in Redis after that one request. A holds its own entries in memory and never
reads Redis for them: after its next hit of forged entries it checks their copies and puts its
own back. Then a primary is killed: every request still answers, only its slots miss. Engine C
runs on a Sentinel set-up with no CPU tier: reuse resumes after a failover, without a restart.

Three engine starts (eager, SmolLM2), shared by the tests of this module.
"""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

import redis  # noqa: E402
from redis_deployments import RedisClusterNodes, SentinelSet, write_secret_file  # noqa: E402
from test_vllm_server import embedded_model_or_skip, rag_client, start_server  # noqa: E402

from lmcache_backend.data.examples import builtin_examples, reordered  # noqa: E402
from lmcache_backend.demos.server import longer  # noqa: E402
from lmcache_backend.integration.vllm import kv_transfer_config  # noqa: E402
from lmcache_backend.integration.vllm.serving.process import metric_total  # noqa: E402
from lmcache_backend.storage.lookup import shm_leftovers  # noqa: E402
from lmcache_backend.storage.lookup.index_dir import default_index_dir  # noqa: E402
from lmcache_backend.storage.remote.auth import MAGIC, TAG_BYTES, EntryAuth  # noqa: E402
from lmcache_backend.storage.serde import _parse_header, decode, encode  # noqa: E402

ARGS = ["--enforce-eager", "--max-model-len", "2400", "--max-num-seqs", "4"]
NO_PREFIX_CACHE = ["--no-enable-prefix-caching"]
SECRET = b"fleet-test-secret-0123456789abcdef"
PREFIX = b"lmcache_backend:segment:"
# four examples of five documents: each prompt stores six segments (the system part, 5 docs)
EXAMPLES = builtin_examples(4, chunks_per_example=5)


@pytest.fixture(scope="module")
def cluster(redis_cluster):
    return redis_cluster


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    return write_secret_file(tmp_path_factory.mktemp("secret"), SECRET)


def _engine(request, tmp_path_factory, name: str, url: str, secret_file: str, args=(), **env: str):
    instance = f"fleet-{name}-{os.getpid()}"
    extra = {
        "shared_secret_file": secret_file,
        "remote_retry_base_delay": 0.2,
        "remote_retry_max_delay": 1.0,
    }
    env = {"LMCACHE_REMOTE_URL": url, "LMCACHE_EXTRA_CONFIG": json.dumps(extra), **env}
    kv = json.dumps(kv_transfer_config(instance_id=instance))
    args = [*ARGS, *args, "--kv-transfer-config", kv]
    tmp = tmp_path_factory.mktemp(f"engine-{name}")
    srv = start_server(request, tmp, embedded_model_or_skip(), args, env)
    srv.index_dir = default_index_dir(instance)
    srv.rag = rag_client(srv, embedded_model_or_skip())
    return srv


@pytest.fixture(scope="module")
def engine_a(request, tmp_path_factory, cluster, secret_file):
    # without vLLM's prefix cache every segment of a prompt A saw comes from its own store
    # (its memory), the system part too: what the holder's check covers
    return _engine(
        request, tmp_path_factory, "a", cluster.node_url(0), secret_file, args=NO_PREFIX_CACHE
    )


@pytest.fixture(scope="module")
def engine_b(request, tmp_path_factory, cluster, secret_file):
    url = f"redis+cluster://{cluster.addresses[1]},{cluster.addresses[2]}"
    return _engine(request, tmp_path_factory, "b", url, secret_file)


class _Values:
    """The cluster's segment values, read and overwritten as another writer of it would."""

    def __init__(self, cluster: RedisClusterNodes) -> None:
        from redis.cluster import RedisCluster

        self.cluster = cluster
        self.client = RedisCluster.from_url(cluster.node_url(0))

    def keys(self) -> set[bytes]:
        found: set[bytes] = set()
        for i in range(len(self.cluster.addresses)):
            node = redis.Redis.from_url(self.cluster.node_url(i))
            try:
                found.update(node.keys(PREFIX + b"*"))
            except redis.exceptions.ConnectionError:  # a killed primary
                pass
            finally:
                node.close()
        return found

    def get(self, rkey: bytes) -> bytes | None:
        return self.client.get(rkey)

    def set(self, rkey: bytes, value: bytes) -> None:
        self.client.set(rkey, value)


def _segment_key(rkey: bytes) -> str:
    return rkey.decode().rsplit(":", 1)[1].strip("{}")  # <prefix>{<key>}: a hash tag


def _genuine(values: _Values, rkey: bytes) -> bool:
    """Whether the value under ``rkey`` is one an engine with the secret uses."""
    data = values.get(rkey)
    if data is None:
        return False
    key = _segment_key(rkey)
    try:
        entry = EntryAuth(SECRET).open(key, data)
        meta = _parse_header(entry)[1]["__metadata__"]
        decode(entry, key, meta["fingerprint"])
    except ValueError:
        return False
    return True


def _forge(values: _Values, rkeys: list[bytes]) -> None:
    """What a writer without the secret can do: no tag, another secret's tag, a genuine value of
    another key (two of each)."""
    other = EntryAuth(b"not-the-fleet-secret-0123456789ab")
    moved = values.get(rkeys[-1])
    for i, rkey in enumerate(rkeys):
        key, data = _segment_key(rkey), values.get(rkey)
        entry = data[len(MAGIC) + TAG_BYTES :]
        meta = _parse_header(entry)[1]["__metadata__"]
        kv = decode(entry, key, None)
        kv.keys.zero_()
        zeros = encode(key, kv, meta["fingerprint"])
        kind = i % 3
        if kind == 0:
            forged = zeros
        elif kind == 1:
            forged = other.seal(key, zeros)
        else:
            forged = moved if rkey != rkeys[-1] else values.get(rkeys[0])
        values.set(rkey, forged)


def _corrupt(values: _Values, rkeys: list[bytes]) -> None:
    """Damage: truncated, a bit flipped inside, trailing bytes, a header byte changed, garbage,
    empty."""
    for i, rkey in enumerate(rkeys):
        data = values.get(rkey)
        damaged = [
            data[: len(data) // 2],
            data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],
            data + b"\0" * 64,
            data[:75] + bytes([data[75] ^ 1]) + data[76:],
            b"\x80\x04not a segment",
            b"",
        ][i % 6]
        values.set(rkey, damaged)


def _salt(example) -> str:
    # the examples share their system part: a salt per example keeps its six segments its own
    return f"fleet-{EXAMPLES.index(example)}"


def _ask(engine, example, seed: int, question: str) -> list[dict]:
    """``example``'s documents reordered by ``seed`` with ``question``: the blend records."""
    before = len(engine.stats())
    docs = reordered(longer(example.chunks, 1), seed)
    engine.rag.ask(example.system, docs, question, 4, cache_salt=_salt(example))
    return engine.stats()[before:]


def _store_example(engine, values: _Values, example) -> list[bytes]:
    """``example``'s documents served by ``engine`` for the first time; the keys it stored."""
    before = values.keys()
    docs = longer(example.chunks, 1)
    engine.rag.ask(example.system, docs, "What is this about?", 2, cache_salt=_salt(example))
    added = sorted(values.keys() - before)
    assert len(added) == 6, "the system part and five documents"
    return added


def _counter(engine, name: str, tier: str = "redis") -> float:
    return metric_total(engine.metrics(), name, tier=tier)


@pytest.fixture(scope="module")
def values(cluster):
    return _Values(cluster)


def test_bad_values_are_replaced_by_the_next_engine_that_reads_them(
    engine_a, engine_b, values
) -> None:
    """6 forged and 6 corrupted entries: each is replaced within the one request of engine B
    that serves its documents, and reuse from Redis is back on B's next request."""
    forged, corrupted = (_store_example(engine_a, values, ex) for ex in EXAMPLES[:2])
    _forge(values, forged)
    _corrupt(values, corrupted)
    assert not any(_genuine(values, k) for k in forged + corrupted)
    for example, rkeys in ((EXAMPLES[0], forged), (EXAMPLES[1], corrupted)):
        records = _ask(engine_b, example, 1, "Who is named first?")
        assert all(r["num_reusable"] <= r["prefix_len"] for r in records), "nothing bad used"
        assert all(_genuine(values, k) for k in rkeys), "replaced within one request"
        (record,) = _ask(engine_b, example, 2, "Who is named last?")
        n = record["num_tokens"]
        assert record["num_reusable"] >= 0.8 * n, "reuse is back"
    assert engine_b.log_text().count("refusing segment") == 12
    deadline = time.monotonic() + 30
    while _counter(engine_b, "vllm:cacheblend_store_replaced_total") < 12:
        assert time.monotonic() < deadline, engine_b.metrics()
        time.sleep(0.5)
    assert _counter(engine_b, "vllm:cacheblend_store_refused_total") == 12


def test_an_engine_holding_its_segments_puts_its_own_back(engine_a, values) -> None:
    """Engine A serves its documents from memory; their Redis copies were forged behind its
    back. Its next request finds them and replaces them with its own."""
    rkeys = _store_example(engine_a, values, EXAMPLES[2])
    _forge(values, rkeys)
    (record,) = _ask(engine_a, EXAMPLES[2], 1, "Which place is named?")
    assert record["num_reusable"] >= 0.8 * record["num_tokens"], "served from its memory"
    deadline = time.monotonic() + 30
    while not all(_genuine(values, k) for k in rkeys):
        assert time.monotonic() < deadline, "A's copies were not put back"
        time.sleep(0.2)
    assert _counter(engine_a, "vllm:cacheblend_store_replaced_total") >= 6


def test_a_killed_engine_leaves_a_record_of_its_shared_memory(engine_a) -> None:
    """The worker records the segments it maps (vLLM's message queues), so that the next start
    after a SIGKILL can unlink them (tests/storage/test_index_dir.py runs the crash loop)."""
    with open(os.path.join(engine_a.index_dir, shm_leftovers.RECORD_FILE)) as fh:
        names = fh.read().split()
    assert names and all(os.path.exists(f"/dev/shm/{n}") for n in names), names


def test_a_killed_primary_costs_only_its_slots(engine_a, engine_b, cluster, values) -> None:
    """Engine B asks documents only the cluster holds (A stored them) after a primary died:
    every request answers, the segments on the other primaries are reused, and /metrics shows
    the dead node down."""
    rkeys = _store_example(engine_a, values, EXAMPLES[3])
    on_node = {cluster.owner(k.decode()) for k in rkeys}
    dead = next(iter(on_node)) if len(on_node) > 1 else (next(iter(on_node)) + 1) % 3
    cluster.kill(dead)
    (record,) = _ask(engine_b, EXAMPLES[3], 1, "Who is named first?")
    lost = sum(cluster.owner(k.decode()) == dead for k in rkeys)
    assert record["num_reusable"] > 0 or lost == len(rkeys)
    (record,) = _ask(engine_b, EXAMPLES[3], 2, "Who is named last?")
    assert record["num_reusable"] >= 0.8 * record["num_tokens"], "B stored what it computed"
    metrics = engine_b.metrics()
    assert metric_total(metrics, "vllm:cacheblend_remote_up", node=cluster.addresses[dead]) == 0
    assert metric_total(metrics, "vllm:cacheblend_remote_outages_total") >= 1


def test_reuse_resumes_after_a_sentinel_failover(request, tmp_path_factory, secret_file) -> None:
    """Engine C on Sentinel, Redis its only tier: its documents are reused before the master is
    killed and again after the replica is promoted, without a restart; every request answers."""
    sentinels = SentinelSet(tmp_path_factory.mktemp("sentinel"))
    sentinels.start()
    request.addfinalizer(sentinels.stop)
    c = _engine(
        request, tmp_path_factory, "c", sentinels.url, secret_file, LMCACHE_LOCAL_CPU="false"
    )
    example = EXAMPLES[0]
    docs = longer(example.chunks, 1)
    c.rag.ask(example.system, docs, "What is this about?", 2, cache_salt=_salt(example))
    sentinels.master.client().wait(1, 5000)  # the replica holds them
    (record,) = _ask(c, example, 1, "Who is named first?")
    assert record["num_reusable"] >= 0.8 * record["num_tokens"]
    sentinels.kill_master_and_wait_failover()
    deadline, seed = time.monotonic() + 120, 2
    while True:
        records = _ask(c, example, seed, "Which place is named?")
        if records and records[0]["num_reusable"] >= 0.8 * records[0]["num_tokens"]:
            break
        assert time.monotonic() < deadline, "reuse did not resume after the failover"
        seed += 1
