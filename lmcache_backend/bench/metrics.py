"""Quality and speed metrics, each a small pure function over plain values or tensors."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """``KL(p_ref || p)`` in nats between the softmax distributions of two ``[vocab]`` logits.

    Computed in fp64 from log-softmax, so tiny probabilities neither underflow nor give NaN.
    """
    if reference_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {reference_logits.shape} vs {logits.shape}")
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    # Clamp: rounding can leave a sum of -1e-17 for identical inputs.
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))


def normalize_answer(text: str) -> str:
    """Lower-case, with runs of whitespace collapsed and the ends stripped."""
    return " ".join(text.lower().split())


def answer_correct(text: str, answers: Sequence[str]) -> bool:
    """A gold answer appears in ``text`` (case-insensitive, whitespace-normalized)."""
    norm = normalize_answer(text)
    return any(normalize_answer(a) in norm for a in answers if a.strip())


def answers_agree(text: str, reference: str) -> bool:
    """Two greedy answers are the same text, ignoring case and whitespace."""
    return normalize_answer(text) == normalize_answer(reference)


def pairwise_ratios(times: Sequence[float], reference_times: Sequence[float]) -> list[float]:
    """``times[i] / reference_times[i]``: each run against the reference run of the same round,
    so both saw the same machine load."""
    if len(times) != len(reference_times):
        raise ValueError(f"{len(times)} runs vs {len(reference_times)} reference runs")
    return [t / r for t, r in zip(times, reference_times)]


def median_ratio(times: Sequence[float], reference_times: Sequence[float]) -> float:
    """Median of the per-round ratios (not the ratio of the medians)."""
    ratios = pairwise_ratios(times, reference_times)
    if not ratios:
        raise ValueError("no runs to compare")
    return statistics.median(ratios)


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, or None for no values."""
    return sum(values) / len(values) if values else None


def recovered_fraction(value: float, worst: float, best: float) -> float | None:
    """How much of the gap from ``worst`` (naive reuse) to ``best`` (full prefill) ``value``
    closes: 0 = no better than naive reuse, 1 = as good as full prefill. None without a gap."""
    gap = best - worst
    if abs(gap) < 1e-12:
        return None
    return (value - worst) / gap
