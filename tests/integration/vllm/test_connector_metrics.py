"""The connector's counters as vLLM carries them to its Prometheus ``/metrics``: each side hands
over what is new after a step, the payload survives vLLM's aggregation and serialisation, and the
API server's metrics add it up (a real server: ``test_vllm_server.py``)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("vllm")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from repo_paths import REPO_ROOT  # noqa: E402
from test_claim_decisions import _hold, _request, scheduler  # noqa: E402,F401

from lmcache_backend.integration.vllm.reporting.metrics import (  # noqa: E402
    METRICS,
    CacheBlendPromMetrics,
    CacheBlendStats,
)


def _registry_types(registry: CollectorRegistry) -> dict:
    def bound(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                kwargs.pop("multiprocess_mode", None)
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_stats_add_up_across_workers_and_steps_and_reduce_for_the_log() -> None:
    a, b = CacheBlendStats(), CacheBlendStats()
    a.inc("vllm:cacheblend_requests_blended")
    a.inc("vllm:cacheblend_store_hits", 3, "cpu")
    a.set_gauge("vllm:cacheblend_store_bytes", 100, "cpu")
    a.observe("vllm:cacheblend_blend_seconds", 0.2)
    b.inc("vllm:cacheblend_store_hits", 2, "cpu")
    b.set_gauge("vllm:cacheblend_store_bytes", 150, "cpu")
    b.observe("vllm:cacheblend_blend_seconds", 0.4)
    a.aggregate(b)
    assert a.data["counters"]["vllm:cacheblend_store_hits"] == {"cpu": 5}
    assert a.data["gauges"]["vllm:cacheblend_store_bytes"] == {"cpu": 150}
    assert a.reduce() == {
        "requests_blended": 1,
        "store_hits[cpu]": 5,
        "store_bytes[cpu]": 150,
        "blend_seconds_avg": 0.3,
    }
    assert CacheBlendStats().is_empty() and not a.is_empty()
    # the engine sends to_dict() to the API server through msgpack
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(a.to_dict()))
    assert wire == a.data


def test_prometheus_metrics_add_each_payload_per_engine() -> None:
    registry = CollectorRegistry()
    prom = CacheBlendPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        _registry_types(registry),
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    labels = {"model_name": "m", "engine": "0"}
    value = registry.get_sample_value
    # series with known labels show at 0 before anything happened
    assert value("vllm:cacheblend_store_misses_total", labels) == 0
    assert value("vllm:cacheblend_blend_seconds_count", labels) == 0
    lora = {**labels, "reason": "lora"}
    assert value("vllm:cacheblend_requests_left_to_vllm_total", lora) == 0
    step = CacheBlendStats()
    step.inc("vllm:cacheblend_requests_left_to_vllm", label="opted out")
    step.inc("vllm:cacheblend_reused_tokens", 700)
    step.set_gauge("vllm:cacheblend_store_bytes", 4096, "cpu")
    step.observe("vllm:cacheblend_blend_seconds", 0.03)
    prom.observe(step.to_dict(), 0)
    prom.observe(step.to_dict(), 0)
    reason = {**labels, "reason": "opted out"}
    assert value("vllm:cacheblend_requests_left_to_vllm_total", reason) == 2
    assert value("vllm:cacheblend_reused_tokens_total", labels) == 1400
    assert value("vllm:cacheblend_store_bytes", {**labels, "tier": "cpu"}) == 4096
    assert value("vllm:cacheblend_blend_seconds_count", labels) == 2
    assert value("vllm:cacheblend_blend_seconds_sum", labels) == pytest.approx(0.06)


def test_the_scheduler_counts_each_request_once_when_it_finishes(scheduler) -> None:  # noqa: F811
    side = scheduler
    tokens = list(range(1000, 1800))
    assert side.num_new_matched_tokens(_request("a", tokens), 0) == 0
    assert side.num_new_matched_tokens(_request("a", tokens), 0) == 0  # asked again
    assert side.num_new_matched_tokens(_request("b", tokens, {"blend": False}), 0) == 0
    _hold(side, tokens, 800)
    claimed = side.num_new_matched_tokens(_request("c", tokens), 0)
    assert claimed > 0
    assert side.take_metrics() is None, "counted when the requests finish"
    for rid in "abc":
        side.finished(_request(rid, tokens))
    counters = side.take_metrics().data["counters"]
    assert counters == {
        "vllm:cacheblend_requests": {"": 3},
        "vllm:cacheblend_requests_left_to_vllm": {"no reusable span": 1, "opted out": 1},
        "vllm:cacheblend_requests_claimed": {"": 1},
        "vllm:cacheblend_claimed_tokens": {"": claimed},
    }
    assert side.take_metrics() is None, "each interval hands over what is new"


def test_every_metric_is_documented() -> None:
    doc = (Path(REPO_ROOT) / "docs" / "vllm.md").read_text()
    section = doc.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(vllm:cacheblend_[a-z_]+)` \| (\w+) \|", section, re.M)
    # Prometheus shows a counter with the suffix _total
    named = {name.removesuffix("_total") if kind == "counter" else name for name, kind in rows}
    assert named == set(METRICS)
    assert {kind for _, kind in rows} == {"counter", "gauge", "histogram"}


def test_the_worker_hands_over_new_blends_and_store_activity_once() -> None:
    import torch

    from lmcache_backend.integration.vllm.reporting.stats import BlendRecord, BlendStats
    from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide
    from lmcache_backend.storage import MemoryTier, TieredStore
    from lmcache_backend.storage.segments import SegmentKV

    side = WorkerSide.__new__(WorkerSide)  # the metrics' state only, no engine
    side.rank, side._records_counted, side._store_counted = 0, 0, {}
    side.stats = BlendStats(num_layers=2, stats_file=None, time_phases=False)
    side.store = TieredStore([MemoryTier("cpu", 1 << 20, name="cpu")])
    kv = SegmentKV(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), 0)
    side.store.put("ab" * 16, kv)
    side.store.get("ab" * 16)
    side.store.get("cd" * 16)

    def record(fallback=None) -> BlendRecord:
        return BlendRecord(
            "r", 1000, 0, 900, 900, 180, 0.2, 0.3, fallback, 250.0, read_share=0.7, divergence=0.04
        )

    side.stats.records += [record(), record("no cached segment")]
    out = side.take_metrics().data
    assert out["counters"] == {
        "vllm:cacheblend_blend_fallbacks": {"": 1},
        "vllm:cacheblend_requests_blended": {"": 1},
        "vllm:cacheblend_prompt_tokens": {"": 1000},
        "vllm:cacheblend_reused_tokens": {"": 720},
        "vllm:cacheblend_recomputed_tokens": {"": 180},
        "vllm:cacheblend_store_hits": {"cpu": 1},
        "vllm:cacheblend_store_stored": {"cpu": 1},
        "vllm:cacheblend_store_stored_bytes": {"cpu": kv.nbytes},
        "vllm:cacheblend_store_misses": {"": 1},
    }
    assert out["gauges"] == {"vllm:cacheblend_store_bytes": {"cpu": kv.nbytes}}
    assert out["observations"] == {
        "vllm:cacheblend_blend_seconds": [0.25],
        "vllm:cacheblend_recompute_share": [0.2],
        "vllm:cacheblend_read_share": [0.7],
        "vllm:cacheblend_divergence": [0.04],
    }
    assert side.take_metrics() is None, "nothing new"
    side.rank = 1
    side.stats.records.append(record())
    assert side.take_metrics() is None, "only rank 0 reports"


def test_the_worker_hands_over_segments_the_store_did_not_admit() -> None:
    import torch

    from lmcache_backend.integration.vllm.reporting.stats import BlendStats
    from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide
    from lmcache_backend.storage import MemoryTier, TieredStore
    from lmcache_backend.storage.segments import SegmentKV

    kv = SegmentKV(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), 0)
    side = WorkerSide.__new__(WorkerSide)  # the metrics' state only, no engine
    side.rank, side._records_counted, side._store_counted = 0, 0, {}
    side.stats = BlendStats(num_layers=2, stats_file=None, time_phases=False)
    tier = MemoryTier("cpu", kv.nbytes, name="cpu", admission="second_sight")
    side.store = TieredStore([tier])
    for key in ("ab" * 16, "cd" * 16, "ef" * 16):  # the store is full after the first
        side.store.put(key, kv)
    counters = side.take_metrics().data["counters"]
    assert counters["vllm:cacheblend_store_admission_skipped"] == {"cpu": 2}
    side.store.put("ef" * 16, kv)  # seen again (still remembered): stored, nothing skipped
    counters = side.take_metrics().data["counters"]
    assert "vllm:cacheblend_store_admission_skipped" not in counters
    assert counters["vllm:cacheblend_store_evictions"] == {"cpu": 1}


def test_the_worker_hands_over_the_shared_tiers_health_per_node() -> None:
    import time

    from redis_server import RedisServer

    from lmcache_backend.integration.vllm.reporting.stats import BlendStats
    from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide
    from lmcache_backend.storage import RedisTier, TieredStore

    server = RedisServer()
    server.start()
    side = WorkerSide.__new__(WorkerSide)  # the metrics' state only, no engine
    side.rank, side._records_counted, side._store_counted = 0, 0, {}
    side.stats = BlendStats(num_layers=2, stats_file=None, time_phases=False)
    tier = RedisTier(server.url, retry_base_delay=0.05, retry_max_delay=0.1)
    side.store = TieredStore([tier])
    node = f"127.0.0.1:{server.port}"
    try:
        assert side.take_metrics().data["gauges"]["vllm:cacheblend_remote_up"] == {node: 1}
        server.stop()
        side.store.get("ab" * 16)  # the first failing command marks the server down
        out = side.take_metrics().data
        assert out["gauges"]["vllm:cacheblend_remote_up"] == {node: 0}
        assert out["counters"]["vllm:cacheblend_remote_outages"] == {node: 1}
        server.start()
        deadline = time.monotonic() + 5
        while not tier.available and time.monotonic() < deadline:
            time.sleep(0.02)
        out = side.take_metrics().data
        assert out["gauges"]["vllm:cacheblend_remote_up"] == {node: 1}
        assert out["counters"]["vllm:cacheblend_remote_reconnects"] == {node: 1}
        assert side.take_metrics() is None, "nothing new"
    finally:
        side.store.close()
        server.stop()
