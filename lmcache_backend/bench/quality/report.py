"""Aggregate per-prompt results into per-strategy numbers, and format them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from lmcache_backend.bench.quality.metrics import (
    mean,
    pairwise_ratios,
    recovered_fraction,
    spearman,
    standard_error,
)
from lmcache_backend.bench.quality.runner import CaseResult
from lmcache_backend.bench.quality.strategies import BLEND, Strategy

_MIB = 1024 * 1024


def _strategy_fields(strategy: Strategy) -> dict[str, Any]:
    return {
        "strategy": strategy.name,
        "kind": strategy.kind,
        "ratios": list(strategy.ratios),
        "check_layers": list(strategy.check_layers),
        "epic_k": strategy.epic_k,
        "prefix_block_size": strategy.block_size,
        "selection": strategy.selection,
    }


def _rate(values: Sequence[bool | None]) -> float | None:
    known = [bool(v) for v in values if v is not None]
    return mean([float(v) for v in known])


def summarize(cases: Sequence[CaseResult], strategies: Sequence[Strategy]) -> list[dict[str, Any]]:
    """One dict per strategy over all ``cases``.

    TTFT ratios are pooled per round: every timed run is divided by the full-prefill run of the
    same prompt and round, and the median of those ratios is reported (``ttft_ratio``, lower is
    faster; ``speedup`` is the median of the inverse ratios).
    """
    rows = []
    full_name = strategies[0].name
    for strategy in strategies:
        outs = [c.outcome(strategy.name) for c in cases]
        ratios, inverse = [], []
        for case, out in zip(cases, outs):
            full = case.outcome(full_name).ttft_s
            ratios += pairwise_ratios(out.ttft_s, full)
            inverse += pairwise_ratios(full, out.ttft_s)
        row = _strategy_fields(strategy)
        f1s = [o.fidelity_f1 for o in outs if o.fidelity_f1 is not None]
        answer_kls = [o.answer_kl for o in outs if o.answer_kl is not None]
        row.update(
            ttft_ms=statistics.median(o.ttft_ms for o in outs),
            ttft_ratio=statistics.median(ratios),
            speedup=statistics.median(inverse),
            recomputed_frac=mean(
                [o.recomputed_tokens / c.prompt_tokens for c, o in zip(cases, outs)]
            ),
            token_layers_frac=mean([o.token_layers_frac for o in outs]),
            accuracy=_rate([o.correct for o in outs]),
            agreement=_rate([o.agrees for o in outs]),
            first_token_agreement=_rate([o.first_token_agrees for o in outs]),
            kl=mean([o.kl for o in outs]),
            fidelity_f1=mean(f1s),
            fidelity_f1_se=standard_error(f1s),
            gold_f1=mean([o.gold_f1 for o in outs if o.gold_f1 is not None]),
            answer_kl=mean(answer_kls),
            answer_kl_se=standard_error(answer_kls),
            answer_top1_agreement=mean(
                [o.answer_top1_agreement for o in outs if o.answer_top1_agreement is not None]
            ),
            margin_median=_median([m for o in outs for m in o.margins or ()]),
            read_share=mean([o.read_share for o in outs if o.read_share is not None]),
            divergence=mean([o.divergence for o in outs if o.divergence is not None]),
            divergence_spearman=_divergence_spearman(outs),
            cache_bytes=mean([float(o.cache_bytes) for o in outs if o.cache_bytes is not None]),
            fallbacks=sum(o.fallback_reason is not None for o in outs),
        )
        rows.append(row)
    _add_vs_naive(rows)
    for row in rows:
        full_accuracy = rows[0]["accuracy"]
        row["accuracy_vs_full"] = (
            row["accuracy"] / full_accuracy
            if row["accuracy"] is not None and full_accuracy
            else None
        )
    return rows


def _divergence_spearman(outs: Sequence[Any]) -> float | None:
    """Spearman's rank correlation over prompts of the divergence estimate with the answer KL
    (how well the estimate ranks the prompts by their measured distance), or None."""
    pairs = [(o.divergence, o.answer_kl) for o in outs if None not in (o.divergence, o.answer_kl)]
    if len(pairs) < 3:
        return None
    return spearman([p[0] for p in pairs], [p[1] for p in pairs])


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _add_vs_naive(rows: list[dict[str, Any]]) -> None:
    """Accuracy change over naive reuse, and the share of naive reuse's loss (accuracy, KL) that a
    strategy wins back (0 = none, 1 = all of it)."""
    full = rows[0]
    naive = next((r for r in rows if r["kind"] == BLEND and r["ratios"] == [0.0]), None)
    for row in rows:
        row["accuracy_vs_naive"] = None
        row["accuracy_recovered"] = None
        row["kl_recovered"] = None
        if naive is None:
            continue
        if row["accuracy"] is not None and naive["accuracy"] is not None:
            row["accuracy_vs_naive"] = row["accuracy"] - naive["accuracy"]
            row["accuracy_recovered"] = recovered_fraction(
                row["accuracy"], naive["accuracy"], full["accuracy"]
            )
        row["kl_recovered"] = recovered_fraction(row["kl"], naive["kl"], full["kl"])


def _with_se(value: float | None, se: float | None) -> str:
    """``0.758±0.043`` (the value alone without a standard error, ``-`` without a value)."""
    if value is None:
        return "-"
    return f"{value:.3f}" if se is None else f"{value:.3f}±{se:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The per-strategy table printed after a run."""
    header = (
        f"{'strategy':<40} {'TTFT ms':>8} {'vs full':>8} {'recomp':>7} {'tok-lay':>7} "
        f"{'acc':>5} {'acc/full':>8} {'agree':>6} {'F1/full ±se':>13} {'F1 gold':>7} {'KL':>7} "
        f"{'ans KL ±se':>13} {'top1':>5} {'margin':>6} {'read':>5} {'div':>6} {'div ρ':>5} "
        f"{'gap closed':>11} "
        f"{'cache MiB':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['strategy']:<40} {r['ttft_ms']:>8.0f} {r['ttft_ratio']:>7.2f}x "
            f"{_pct(r['recomputed_frac']):>7} {_pct(r['token_layers_frac']):>7} "
            f"{_pct(r['accuracy']):>5} {_pct(r['accuracy_vs_full']):>8} "
            f"{_pct(r['agreement']):>6} {_with_se(r['fidelity_f1'], r['fidelity_f1_se']):>13} "
            f"{_num(r['gold_f1'], '.3f'):>7} {r['kl']:>7.3f} "
            f"{_with_se(r['answer_kl'], r['answer_kl_se']):>13} "
            f"{_pct(r['answer_top1_agreement']):>5} {_num(r['margin_median'], '.2f'):>6} "
            f"{_pct(r['read_share']):>5} {_num(r['divergence'], '.4f'):>6} "
            f"{_num(r['divergence_spearman'], '.2f'):>5} "
            f"{_pct(r['accuracy_recovered']) + ' / ' + _pct(r['kl_recovered']):>11} "
            f"{_num(None if r['cache_bytes'] is None else r['cache_bytes'] / _MIB, '.1f'):>9}"
        )
    fallbacks = [f"{r['strategy']} ({r['fallbacks']})" for r in rows if r["fallbacks"]]
    if fallbacks:
        lines.append("computed everything on some prompts: " + ", ".join(fallbacks))
    return "\n".join(lines)


LEGEND = (
    "TTFT ms: median over prompts of each prompt's median; vs full: median of per-round TTFT\n"
    "ratios to full prefill (lower is faster); recomp: prompt tokens computed in the last layer;\n"
    "tok-lay: token-layers computed; acc: a gold answer is in the greedy answer; acc/full:\n"
    "acc as a share of full prefill's; agree: same greedy answer as full prefill; F1/full: the\n"
    "CacheBlend paper's F1 of the answer against full prefill's (fidelity); F1 gold: against the\n"
    "gold answers; KL: first-token KL(full || strategy), mean; ans KL: KL(full || strategy) per\n"
    "token of full prefill's answer (its first line, teacher-forced), mean; ±se: standard error\n"
    "of the mean over prompts; top1: share of those forced tokens whose top choice is full\n"
    "prefill's; margin: full prefill's log-prob gap between its top two tokens, median over its\n"
    "answer's tokens (full prefill's row) or over the tokens where the strategy's top choice\n"
    "differs (the others; small = a near-tie); read: share of the question's reads of the reused\n"
    "text held by the recomputed tokens (preview selections); div: the blend's divergence\n"
    "estimate, mean; div ρ: its Spearman rank correlation with ans KL over prompts; gap closed:\n"
    "share of naive reuse's loss won back, accuracy / KL; cache MiB: cached K/V the strategy\n"
    "draws on."
)


def format_sweep(cases: Sequence[CaseResult], strategies: Sequence[Strategy]) -> str:
    """TTFT (ms) and ratio to full prefill per strategy, one column per prompt size."""
    heads = [f"{c.prompt_tokens}t/{c.num_chunks}c" for c in cases]
    header = f"{'strategy':<26} " + " ".join(f"{h:>16}" for h in heads)
    lines = [header, "-" * len(header)]
    for strategy in strategies:
        cells = []
        for case in cases:
            out = case.outcome(strategy.name)
            cells.append(f"{out.ttft_ms:>7.0f} ({out.ttft_ratio:.2f}x)")
        lines.append(f"{strategy.name:<26} " + " ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def case_dicts(cases: Sequence[CaseResult]) -> list[dict[str, Any]]:
    """Per-prompt results for JSON, with each strategy's median TTFT added."""
    out = []
    for case in cases:
        d = asdict(case)
        for o, obj in zip(d["outcomes"], case.outcomes):
            o["ttft_ms"] = obj.ttft_ms
        out.append(d)
    return out
