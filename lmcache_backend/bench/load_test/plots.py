"""PNG plots of a load benchmark result: throughput and reuse over time, TTFT distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcache_backend.bench.quality.plots import _pyplot


def write_load_plots(result: dict[str, Any], folder: str | Path) -> list[Path]:
    """``load_over_time.png`` (requests/s per window over time; per window of requests the share
    of requests blended, of prompt tokens found in the store and of prompt tokens reused) and
    ``ttft_distribution.png`` (empirical CDF of TTFT and of inter-token gaps per phase)."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    phases = result["phases"]
    paths = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    for name, p in phases.items():
        tw = [w for w in p["throughput_windows"] if w["requests_per_s"] is not None]
        ax1.plot([w["end_s"] for w in tw], [w["requests_per_s"] for w in tw], "o-", label=name)
        sw = p["stats_windows"]
        if sw and name != "full prefill":
            xs = [w["requests"] for w in sw]
            ax2.plot(xs, [w["blended_share"] for w in sw], "o-", label=f"{name}: blended")
            ax2.plot(xs, [w["found_share"] for w in sw], "^:", label=f"{name}: tokens found")
            ax2.plot(xs, [w["reused_share"] for w in sw], "s--", label=f"{name}: tokens reused")
    ax1.set(xlabel="seconds into the phase", ylabel="requests/s (per window of requests)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("throughput over time")
    ax1.legend(fontsize=8)
    ax2.set(xlabel="requests (end of window)", ylabel="share", ylim=(0, 1.05))
    ax2.set_title("reuse over time")
    if ax2.lines:
        ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    paths.append(_save(fig, folder / "load_over_time.png", plt))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    for name, p in phases.items():
        ok = [r for r in p["requests"] if r and r["ok"]]
        _cdf(ax1, [1000 * r["ttft_s"] for r in ok if r["ttft_s"] is not None], name)
        _cdf(ax2, [1000 * g for r in ok for g in r["gaps_s"]], name)
    ax1.set(xlabel="time to first token, ms", ylabel="share of requests", ylim=(0, 1.02))
    ax1.set_title("TTFT distribution")
    ax2.set(xlabel="gap between streamed tokens, ms", ylabel="share of gaps", ylim=(0, 1.02))
    ax2.set_xscale("log")
    ax2.set_title("inter-token latency distribution")
    for ax in (ax1, ax2):
        if ax.lines:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    paths.append(_save(fig, folder / "ttft_distribution.png", plt))
    return paths


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def _title(result: dict[str, Any]) -> str:
    a, s = result["args"], result["setup"]
    return (
        f"{s.get('model', '')}: {s['mode']}, {a['requests']} requests per phase, "
        f"k={a['k']} of {a['corpus_chunks']} chunks, Zipf {a['zipf']}"
    )


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
