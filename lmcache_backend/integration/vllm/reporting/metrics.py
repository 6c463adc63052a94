"""The connector's counters in vLLM's Prometheus ``/metrics`` (vLLM 0.11.2 and later).

The connector runs in vLLM's engine-core process (scheduler side) and in its worker processes,
not in the API server that serves ``/metrics``. vLLM carries a connector's statistics there
itself: after every step the model runner calls the worker connector's
``get_kv_connector_stats()``, the executor aggregates the workers' objects, the scheduler adds its
own connector's ``get_kv_connector_stats()`` and sends the payload (``to_dict()``) with the step's
``SchedulerStats``; in the API server ``build_prom_metrics()`` registered the connector's metrics
and ``observe()`` adds each payload to them (and ``build_kv_connector_stats()`` rebuilds the
payload for the periodic ``KV Transfer metrics:`` log line). This is how vLLM's own connectors
(NIXL, the offloading connectors) export theirs.

Each side hands over only what happened since its last call (counter increments, histogram
observations, the latest gauge values), so the payload stays small and nothing is counted twice.
The payload is plain JSON-like data: it crosses process boundaries through msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

try:  # vLLM 0.11 and later
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # older releases never ask for connector stats

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data


try:  # vLLM 0.11.2 and later
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:  # build_prom_metrics is never called there
    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

#: name -> (type, label name or None, help text). Every name is documented in docs/vllm.md.
METRICS: dict[str, tuple[str, str | None, str]] = {
    "vllm:cacheblend_requests": (
        COUNTER,
        None,
        "Requests the CacheBlend connector decided on (claimed or left to vLLM), counted when "
        "they finish.",
    ),
    "vllm:cacheblend_requests_claimed": (
        COUNTER,
        None,
        "Requests whose prompt the connector claimed for blending.",
    ),
    "vllm:cacheblend_requests_left_to_vllm": (
        COUNTER,
        "reason",
        "Requests the connector left to vLLM's own prefill, by reason.",
    ),
    "vllm:cacheblend_claimed_tokens": (
        COUNTER,
        None,
        "Prompt tokens the connector claimed (beyond vLLM's own prefix-cache hit).",
    ),
    "vllm:cacheblend_requests_blended": (
        COUNTER,
        None,
        "Claimed requests whose prompt was blended.",
    ),
    "vllm:cacheblend_blend_fallbacks": (
        COUNTER,
        None,
        "Claimed requests the blender computed in full instead (the log says why).",
    ),
    "vllm:cacheblend_prompt_tokens": (
        COUNTER,
        None,
        "Prompt tokens of the blended requests.",
    ),
    "vllm:cacheblend_reused_tokens": (
        COUNTER,
        None,
        "Prompt tokens of blended requests whose K/V came from the store or vLLM's prefix "
        "cache and were not recomputed.",
    ),
    "vllm:cacheblend_recomputed_tokens": (
        COUNTER,
        None,
        "Reusable prompt tokens of blended requests that the blend recomputed.",
    ),
    "vllm:cacheblend_blend_seconds": (
        HISTOGRAM,
        None,
        "Time the blend of one request took (its own compute time, not vLLM's forward pass).",
    ),
    "vllm:cacheblend_recompute_share": (
        HISTOGRAM,
        None,
        "Share of a blended request's reusable tokens that the blend recomputed.",
    ),
    "vllm:cacheblend_read_share": (
        HISTOGRAM,
        None,
        "Share of what a blended request's question reads of the reused text that the "
        "recomputed tokens hold (preview selections; blend_min_read_share targets it).",
    ),
    "vllm:cacheblend_divergence": (
        HISTOGRAM,
        None,
        "A blended request's divergence estimate: the staleness-weighted share of its last "
        "prompt token's attention left on tokens not recomputed (preview selections; "
        "blend_max_divergence bounds it).",
    ),
    "vllm:cacheblend_store_hits": (COUNTER, "tier", "Segment loads served, by store tier."),
    "vllm:cacheblend_store_misses": (
        COUNTER,
        None,
        "Segment loads no tier could serve (the segment is recomputed).",
    ),
    "vllm:cacheblend_store_stored": (COUNTER, "tier", "Segments written, by store tier."),
    "vllm:cacheblend_store_stored_bytes": (
        COUNTER,
        "tier",
        "Bytes of the segments written, by store tier.",
    ),
    "vllm:cacheblend_store_evictions": (
        COUNTER,
        "tier",
        "Segments that left a store tier (evicted, or removed as refused), by tier.",
    ),
    "vllm:cacheblend_store_refused": (
        COUNTER,
        "tier",
        "Values a store tier refused and removed because they failed verification (a missing "
        "or wrong authentication tag, a damaged or truncated entry, another model's or another "
        "length's), by tier.",
    ),
    "vllm:cacheblend_store_replaced": (
        COUNTER,
        "tier",
        "Refused values a genuine one then replaced under the same key, by tier.",
    ),
    "vllm:cacheblend_store_admission_skipped": (
        COUNTER,
        "tier",
        "New segments a store tier did not keep: its admission policy wanted a second sight.",
    ),
    "vllm:cacheblend_store_bytes": (
        GAUGE,
        "tier",
        "Bytes the store holds, by tier (0 for Redis: its memory is the server's).",
    ),
    "vllm:cacheblend_remote_up": (
        GAUGE,
        "node",
        "1 while a server of the shared tier is reachable, 0 while its keys miss, by node "
        "(host:port; a Sentinel master: sentinel/<name>).",
    ),
    "vllm:cacheblend_remote_outages": (
        COUNTER,
        "node",
        "Times a server of the shared tier became unreachable, by node.",
    ),
    "vllm:cacheblend_remote_reconnects": (
        COUNTER,
        "node",
        "Times a server of the shared tier answered again after an outage, by node.",
    ),
    "vllm:cacheblend_remote_refused": (
        COUNTER,
        "node",
        "Values a server of the shared tier refused to store (OOM, READONLY, ...) and values "
        "read from it that were refused (authentication), by node.",
    ),
}

#: seconds; a blend takes milliseconds on a GPU, up to seconds on a CPU
BLEND_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: buckets of the histograms of shares (0..1)
SHARE_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
#: each histogram's buckets
HISTOGRAM_BUCKETS = {
    "vllm:cacheblend_blend_seconds": BLEND_SECONDS_BUCKETS,
    "vllm:cacheblend_recompute_share": SHARE_BUCKETS,
    "vllm:cacheblend_read_share": SHARE_BUCKETS,
    "vllm:cacheblend_divergence": SHARE_BUCKETS,
}

_KINDS = {COUNTER: "counters", GAUGE: "gauges", HISTOGRAM: "observations"}


@dataclass
class CacheBlendStats(KVConnectorStats):
    """One interval's increments: ``data = {"counters": {name: {label: n}}, "gauges": {name:
    {label: v}}, "observations": {name: [v, ...]}}``; ``label`` is ``""`` for unlabelled
    metrics. Counters and observations add up across workers and steps; gauges keep the latest
    value. With tensor parallelism only rank 0 reports (its records and its store: its shard of
    the KV heads)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "observations": {}}

    def inc(self, name: str, value: float = 1, label: str = "") -> None:
        if value:
            slot = self.data["counters"].setdefault(name, {})
            slot[label] = slot.get(label, 0) + value

    def set_gauge(self, name: str, value: float, label: str = "") -> None:
        self.data["gauges"].setdefault(name, {})[label] = value

    def observe(self, name: str, value: float) -> None:
        self.data["observations"].setdefault(name, []).append(value)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other`` (this interval's stats of another worker or a later step) in place."""
        data = other.data if other is not None else {}
        for name, labels in data.get("counters", {}).items():
            for label, value in labels.items():
                self.inc(name, value, label)
        mine = self.data["gauges"]
        for name, labels in data.get("gauges", {}).items():
            slot = mine.setdefault(name, {})
            for label, value in labels.items():
                slot[label] = value
        for name, values in data.get("observations", {}).items():
            self.data["observations"].setdefault(name, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """A flat summary of the interval for vLLM's ``KV Transfer metrics:`` log line."""
        out: dict[str, int | float] = {}
        for kind in ("counters", "gauges"):
            for name, labels in self.data[kind].items():
                for label, value in labels.items():
                    short = name.removeprefix("vllm:cacheblend_")
                    out[f"{short}[{label}]" if label else short] = value
        for name, values in self.data["observations"].items():
            if values:
                short = name.removeprefix("vllm:cacheblend_")
                out[f"{short}_avg"] = round(sum(values) / len(values), 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(kind) for kind in ("counters", "gauges", "observations"))


class CacheBlendPromMetrics(KVConnectorPromMetrics):
    """Registers :data:`METRICS` in the API server and adds each interval's payload to them."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name, (kind, label, doc) in METRICS.items():
            names = labelnames + ([label] if label else [])
            if kind == COUNTER:
                metric = self._counter_cls(name=name, documentation=doc, labelnames=names)
            elif kind == GAUGE:
                metric = self._gauge_cls(
                    name=name, documentation=doc, labelnames=names, multiprocess_mode="mostrecent"
                )
            else:
                metric = self._histogram_cls(
                    name=name, documentation=doc, labelnames=names, buckets=HISTOGRAM_BUCKETS[name]
                )
            self._metrics[name] = metric
        self._children: dict[tuple[int, str, str], Any] = {}
        # every series whose labels are known shows from the start, at 0
        from lmcache_backend.integration.vllm.reporting.stats import SKIP_REASONS

        for engine_idx in per_engine_labelvalues:
            for name, (kind, label, _) in METRICS.items():
                if label is None and kind != GAUGE:
                    self._child(engine_idx, name, "")
            for reason in SKIP_REASONS:
                self._child(engine_idx, "vllm:cacheblend_requests_left_to_vllm", reason)

    def _child(self, engine_idx: int, name: str, label: str) -> Any:
        key = (engine_idx, name, label)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx])
            if METRICS[name][1]:
                values.append(label)
            child = self._children[key] = self._metrics[name].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, labels in transfer_stats_data.get("counters", {}).items():
            if name in METRICS:
                for label, value in labels.items():
                    self._child(engine_idx, name, label).inc(value)
        for name, labels in transfer_stats_data.get("gauges", {}).items():
            if name in METRICS:
                for label, value in labels.items():
                    self._child(engine_idx, name, label).set(value)
        for name, values in transfer_stats_data.get("observations", {}).items():
            if name in METRICS:
                child = self._child(engine_idx, name, "")
                for value in values:
                    child.observe(value)


def take(stats: CacheBlendStats) -> tuple[CacheBlendStats | None, CacheBlendStats]:
    """``(stats or None when empty, a fresh object)``: hand an interval over, start the next."""
    return (None if stats.is_empty() else stats), CacheBlendStats()
