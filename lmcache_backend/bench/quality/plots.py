"""PNG plots of a benchmark result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_FULL_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plots needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _single_ratio_blend(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CacheBlend rows with one ratio at the default check layers (naive reuse included),
    ordered by ratio: the ratio axis."""
    blend = [r for r in rows if r["kind"] == "blend" and len(r["ratios"]) == 1]
    layers = min((tuple(r["check_layers"]) for r in blend), default=(), key=len)
    return sorted(
        (r for r in blend if tuple(r["check_layers"]) == layers or r["ratios"] == [0.0]),
        key=lambda r: r["ratios"][0],
    )


def plot_quality(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Accuracy and agreement vs CacheBlend ratio, KL vs ratio, and accuracy vs compute for
    every strategy."""
    plt = _pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    series = _single_ratio_blend(rows)
    full = rows[0]
    xs = [r["ratios"][0] for r in series]
    if full["accuracy"] is not None:
        ax1.plot(xs, [r["accuracy"] for r in series], "o-", label="CacheBlend accuracy")
        ax1.plot(xs, [r["agreement"] for r in series], "s-", label="agreement with full prefill")
        ax1.axhline(full["accuracy"], label="full prefill accuracy", **_FULL_STYLE)
    ax1.set(
        xlabel="recompute ratio (0 = naive reuse)", ylabel="fraction of prompts", ylim=(0, 1.05)
    )
    ax1.set_title("answers vs ratio")
    ax1.legend(fontsize=8, loc="lower right")
    ax2.plot(xs, [r["kl"] for r in series], "o-", color="tab:red")
    ax2.set(xlabel="recompute ratio (0 = naive reuse)", ylabel="first-token KL vs full (nats)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("first-token KL vs ratio")
    markers = "osD^v<>px*h"
    for i, r in enumerate(rows):
        if r["accuracy"] is not None:  # a legend, not labels: points of similar cost overlap
            x = 100 * r["token_layers_frac"]
            ax3.plot(x, r["accuracy"], markers[i % len(markers)], ms=8, label=r["strategy"])
    if any(r["accuracy"] is not None for r in rows):
        ax3.legend(fontsize=7, loc="lower right")
    ax3.set(xlabel="token-layers computed (%)", ylabel="answer accuracy", ylim=(0, 1.05))
    ax3.set_xlim(0, 110)
    ax3.set_title("accuracy vs compute, every strategy")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_frontier(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Accuracy (share of full prefill's) and first-token KL against token-layers computed: one
    line per selector through its single-ratio strategies, naive reuse, EPIC and gradual
    schedules as points."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    full = rows[0]
    by_selection: dict[str, list[dict[str, Any]]] = {}
    points = []
    for r in rows[1:]:
        if r["kind"] == "blend" and len(r["ratios"]) == 1 and r["ratios"] != [0.0]:
            by_selection.setdefault(r.get("selection") or "configured", []).append(r)
        elif r["kind"] in ("blend", "epic"):
            points.append(r)
    for name, series in sorted(by_selection.items()):
        series.sort(key=lambda r: r["token_layers_frac"])
        xs = [100 * r["token_layers_frac"] for r in series]
        ax1.plot(xs, [r.get("accuracy_vs_full") or 0.0 for r in series], "o-", label=name)
        ax2.plot(xs, [r["kl"] for r in series], "o-", label=name)
    for r in points:
        x = 100 * r["token_layers_frac"]
        ax1.plot(x, r.get("accuracy_vs_full") or 0.0, "x", ms=9, label=r["strategy"])
        ax2.plot(x, r["kl"], "x", ms=9, label=r["strategy"])
    ax1.axhline(1.0, label=f"{full['strategy']}", **_FULL_STYLE)
    ax1.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    ax1.axvline(25, color="grey", linestyle=":", linewidth=1)
    ax1.set(xlabel="token-layers computed (%)", ylabel="accuracy / full prefill's", ylim=(0, 1.2))
    ax2.set(xlabel="token-layers computed (%)", ylabel="first-token KL vs full (nats)")
    ax2.axhline(0.05, color="grey", linestyle=":", linewidth=1)
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_xlim(0, 60)
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_title("accuracy frontier per selector")
    ax2.set_title("first-token KL per selector")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft(
    cases: list[dict[str, Any]],
    x_key: str,
    x_label: str,
    path: Path,
    title: str,
    lines: bool = True,
) -> Path:
    """TTFT ratio to full prefill (left) and TTFT in ms (right) of every strategy against
    ``x_key`` of each case (``prompt_tokens`` or ``num_chunks``). ``lines=False`` draws points
    only (a dataset's prompts are not a series)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ordered = sorted(cases, key=lambda c: c[x_key])
    xs = [c[x_key] for c in ordered]
    names = [o["strategy"] for o in ordered[0]["outcomes"]]
    for i, name in enumerate(names):
        outs = [next(o for o in c["outcomes"] if o["strategy"] == name) for c in ordered]
        style = _FULL_STYLE if i == 0 else {"marker": "o"}
        if not lines:
            style = {"marker": "x" if i == 0 else "o", "linestyle": "none"}
        ax1.plot(xs, [o["ttft_ratio"] for o in outs], label=name, **style)
        ax2.plot(xs, [o["ttft_ms"] for o in outs], label=name, **style)
    ax1.set(xlabel=x_label, ylabel="TTFT / full-prefill TTFT (lower is faster)")
    ax1.set_ylim(bottom=0)
    ax2.set(xlabel=x_label, ylabel="TTFT (ms, median)")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if len(set(xs)) <= 8:  # a sweep: label its sizes; a dataset's many sizes would crowd
            ax.set_xticks(sorted(set(xs)))
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], folder: str | Path) -> list[Path]:
    """Every plot the result supports, as PNGs in ``folder`` (created); returns their paths."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    about = result["setup"]
    title = (
        f"{about['model']} ({about['engine']}), {len(result['examples'])} prompts, "
        f"chunks reordered after caching"
    )
    paths = []
    if result["strategies"]:
        paths.append(plot_quality(result["strategies"], out / "accuracy_vs_ratio.png", title))
        paths.append(plot_frontier(result["strategies"], out / "frontier.png", title))
    sweep = result.get("sweep")
    if sweep and sweep["by_length"]:
        paths.append(
            plot_ttft(
                sweep["by_length"],
                "prompt_tokens",
                "prompt tokens",
                out / "ttft_vs_context_length.png",
                f"{about['model']}: TTFT vs context length "
                f"({sweep['by_length'][0]['num_chunks']} chunks)",
            )
        )
    if sweep and sweep["by_chunks"]:
        paths.append(
            plot_ttft(
                sweep["by_chunks"],
                "num_chunks",
                "chunks in the prompt",
                out / "ttft_vs_chunks.png",
                f"{about['model']}: TTFT vs number of chunks "
                f"(~{sweep['by_chunks'][0]['prompt_tokens']} tokens)",
            )
        )
    if not sweep:
        paths.append(
            plot_ttft(
                result["examples"],
                "prompt_tokens",
                "prompt tokens",
                out / "ttft_vs_context_length.png",
                f"{about['model']}: TTFT per prompt of the dataset",
                lines=False,
            )
        )
    return paths
