"""The load benchmark's arithmetic: percentiles, per-phase summaries, windows of requests over the
server's ``stats_file`` and its ``/metrics``, and the printed table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: the connector's counters read from ``/metrics`` at each window's end (docs/vllm.md, Metrics)
METRIC_COUNTERS = (
    "vllm:cacheblend_requests_total",
    "vllm:cacheblend_requests_blended_total",
    "vllm:cacheblend_prompt_tokens_total",
    "vllm:cacheblend_reused_tokens_total",
    "vllm:cacheblend_store_hits_total",
    "vllm:cacheblend_store_misses_total",
    "vllm:cacheblend_store_stored_bytes_total",
    "vllm:cacheblend_store_evictions_total",
    "vllm:cacheblend_store_bytes",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), numpy's (linear interpolation between closest ranks);
    None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def summarize_phase(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One phase's figures from its requests' results (``ok``, ``ttft_s``, ``gaps_s``,
    ``mixed``, ``own``, ``tokens``, ``end_s``)."""
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    gaps = [g for r in ok for g in r["gaps_s"]]
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall_s if wall_s > 0 else None,
        "mixed_up": sum(bool(r["mixed"]) for r in ok),
        "own_fact": sum(r["own"] for r in ok),
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_s"] = percentile(ttft, q)
    out["itl_p50_s"] = percentile(gaps, 50)
    out["itl_p99_s"] = percentile(gaps, 99)
    out["itl_max_s"] = max(gaps) if gaps else None
    return out


def attach_lines(results: list[dict[str, Any]], lines: list[dict[str, Any]]) -> None:
    """Give each result the connector's verdict on its request (``blended``, ``reason``,
    ``num_reusable``, ``blend_ms``): the ``stats_file`` line whose ``req_id`` is the response's
    id (vLLM may append a suffix of its own); the last line counts (a preempted request is
    blended again)."""
    by_id: dict[str, dict[str, Any]] = {}
    for line in lines:
        rid = str(line.get("req_id") or "")
        by_id[rid] = line
        by_id["~" + rid.rsplit("-", 1)[0]] = line
    for r in results:
        rid = r.get("response_id") or ""
        line = by_id.get(rid) or by_id.get(f"~{rid}")
        if line is not None:
            r["connector"] = {
                "blended": _blended(line),
                "reason": line.get("reason") or line.get("fallback_reason"),
                "num_tokens": line.get("num_tokens"),
                "num_reusable": line.get("num_reusable"),
                "blend_ms": line.get("blend_ms"),
            }


def ttft_by_outcome(results: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT percentiles of the requests the connector blended and of the others (those matched
    to a ``stats_file`` line)."""
    out = {}
    for name, want in (("blended", True), ("not_blended", False)):
        ttft = [
            r["ttft_s"]
            for r in results
            if r["ok"] and r["ttft_s"] is not None and r.get("connector", {}).get("blended") is want
        ]
        out[name] = {
            "requests": len(ttft),
            **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 90)},
        }
    return out


def throughput_windows(results: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    """Requests per second over consecutive windows of ``window`` completed requests (in order of
    completion): the window's requests over the time since the previous window ended."""
    done = sorted(r["end_s"] for r in results if r["ok"])
    out, last = [], 0.0
    for start in range(0, len(done), window):
        chunk = done[start : start + window]
        span = chunk[-1] - last
        out.append(
            {
                "requests": start + len(chunk),
                "end_s": chunk[-1],
                "requests_per_s": len(chunk) / span if span > 0 else None,
            }
        )
        last = chunk[-1]
    return out


def stats_windows(lines: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    """The connector's ``stats_file`` lines (one per request it saw, in order) in windows of
    ``window``: the share of requests blended, of prompt tokens found in the store or vLLM's
    prefix cache when the request was claimed or left to vLLM (``num_reusable`` of every line:
    the store's hit rate in tokens), and of prompt tokens reused (``num_reusable`` of blended
    lines), both over every line's ``num_tokens``."""
    out = []
    for start in range(0, len(lines), window):
        chunk = lines[start : start + window]
        blended = [x for x in chunk if _blended(x)]
        tokens = sum(int(x.get("num_tokens") or 0) for x in chunk)
        reused = sum(int(x.get("num_reusable") or 0) for x in blended)
        found = sum(int(x.get("num_reusable") or 0) for x in chunk)
        out.append(
            {
                "requests": start + len(chunk),
                "blended_share": len(blended) / len(chunk),
                "found_share": found / tokens if tokens else 0.0,
                "reused_share": reused / tokens if tokens else 0.0,
                "recomputed_tokens": sum(int(x.get("recomputed_reusable") or 0) for x in blended),
                # the blends' own time: a synchronous blend holds up every running request
                "blend_s": sum(float(x.get("blend_ms") or 0.0) for x in blended) / 1000.0,
                "blend_ms_p50": percentile([float(x.get("blend_ms") or 0.0) for x in blended], 50),
                "left_to_vllm": _count(x.get("reason") for x in chunk if not _blended(x)),
            }
        )
    return out


def _blended(line: dict[str, Any]) -> bool:
    return line.get("blended", True) is not False and not line.get("fallback_reason")


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        key = str(item)
        out[key] = out.get(key, 0) + 1
    return out


def metric_window(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the connector's counters say about the interval between two scrapes: the store's hit
    rate (segment loads served), the reused share of blended prompts, bytes stored, segments
    evicted and their bytes (stored minus the growth of what is held), bytes held at the end."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRIC_COUNTERS}
    loads = d["vllm:cacheblend_store_hits_total"] + d["vllm:cacheblend_store_misses_total"]
    prompt = d["vllm:cacheblend_prompt_tokens_total"]
    return {
        "store_hits": d["vllm:cacheblend_store_hits_total"],
        "store_misses": d["vllm:cacheblend_store_misses_total"],
        "store_hit_rate": d["vllm:cacheblend_store_hits_total"] / loads if loads else None,
        "blended": d["vllm:cacheblend_requests_blended_total"],
        "reused_share_of_blended": d["vllm:cacheblend_reused_tokens_total"] / prompt
        if prompt
        else None,
        "stored_bytes": d["vllm:cacheblend_store_stored_bytes_total"],
        # what was written and is no longer held (evicted or removed)
        "evicted_bytes": d["vllm:cacheblend_store_stored_bytes_total"]
        - d["vllm:cacheblend_store_bytes"],
        "evictions": d["vllm:cacheblend_store_evictions_total"],
        "store_bytes": after.get("vllm:cacheblend_store_bytes", 0.0),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def format_table(phases: dict[str, dict[str, Any]]) -> str:
    """One line per phase."""
    head = (
        f"{'phase':<16} {'done':>6} {'err':>4} {'req/s':>6} {'TTFT p50':>9} {'p90':>7} "
        f"{'p99':>7} {'ITL p99':>8} {'blended':>8} {'found':>6} {'reused':>7} {'mixed':>6}"
    )
    lines = [head, "-" * len(head)]
    for name, p in phases.items():
        s, st = p["summary"], p.get("stats") or {}
        rps = s["requests_per_s"]
        lines.append(
            f"{name:<16} {s['completed']:>6} {s['errors']:>4} "
            f"{'-' if rps is None else f'{rps:.2f}':>6} {_ms(s['ttft_p50_s']):>9} "
            f"{_ms(s['ttft_p90_s']):>7} {_ms(s['ttft_p99_s']):>7} {_ms(s['itl_p99_s']):>8} "
            f"{_pct(st.get('blended_share')):>8} {_pct(st.get('found_share')):>6} "
            f"{_pct(st.get('reused_share')):>7} {s['mixed_up']:>6}"
        )
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


LEGEND = (
    "full prefill: opted out, a cache_salt of its own per request (neither vLLM's prefix cache "
    "nor the store serves it), nothing stored (lmcache.skip_save); prefix caching: opted out, "
    "no salt; "
    "TTFT and ITL in ms (client side, streamed); ITL: gaps between a stream's tokens; "
    "blended: share of requests blended; found, reused: share of prompt tokens the store (or "
    "vLLM's prefix cache) held when asked, and that blends reused (stats file); mixed: answers "
    "holding another request's number"
)
