"""Quality and speed metrics, each a small pure function over plain values or tensors."""

from __future__ import annotations

import re
import statistics
import string
from collections import Counter
from collections.abc import Callable, Sequence

import torch


def _require_same_shape(reference_logits: torch.Tensor, logits: torch.Tensor) -> None:
    if reference_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {reference_logits.shape} vs {logits.shape}")


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """``KL(p_ref || p)`` in nats between the softmax distributions of two ``[vocab]`` logits.

    Computed in fp64 from log-softmax, so tiny probabilities neither underflow nor give NaN.
    """
    _require_same_shape(reference_logits, logits)
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


def first_line(text: str) -> str:
    """The part of a generated answer that the CacheBlend paper grades (its
    ``parse_generation``): the first line after leading newlines, with an answer starting
    with yes/no reduced to ``Yes``/``No``."""
    line = text.lstrip("\n").split("\n")[0]
    words = line.split()
    if line.startswith(("Yes", "yes")):
        return "Yes"
    if words and words[0].startswith(("No", "no")):
        return "No"
    return line


def squad_normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def answer_f1(prediction: str, reference: str, encode: Callable[[str], Sequence[int]]) -> float:
    """The CacheBlend paper's F1 (``compute_f1``): token-level F1 between the first line of a
    generated ``prediction`` and a ``reference`` answer, both SQuAD-normalized and tokenized by
    ``encode`` (the benchmarked model's tokenizer, without special tokens). 1.0 when both are
    empty, 0.0 when only one is."""
    pred = list(encode(squad_normalize(first_line(prediction))))
    gold = list(encode(squad_normalize(reference)))
    if not pred or not gold:
        return float(pred == gold)
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def answer_span(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[int]:
    """The leading ``token_ids`` of a generated answer that :func:`answer_f1` reads: up to and
    including the token that ends its first line of text (all of them when none does)."""
    for end in range(1, len(token_ids) + 1):
        if "\n" in decode(token_ids[:end]).lstrip("\n"):
            return list(token_ids[:end])
    return list(token_ids)


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over rows of ``KL(p_ref || p)`` between ``[N, vocab]`` logits (see
    :func:`kl_divergence`); 0.0 for no rows."""
    _require_same_shape(reference_logits, logits)
    rows = [kl_divergence(r, x) for r, x in zip(reference_logits, logits)]
    return sum(rows) / len(rows) if rows else 0.0


def top1_margins(logits: torch.Tensor) -> torch.Tensor:
    """``[N]`` log-probability gap between the best and the second-best token of each row of
    ``[N, vocab]`` logits: how close a greedy choice was to a tie (0 = a tie)."""
    top2 = torch.log_softmax(logits.double(), dim=-1).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def forced_flips(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, list[float]]:
    """Along a teacher-forced answer (``[N, vocab]`` logits each): the share of the ``N`` steps
    at which ``logits`` pick the same top token as ``reference_logits`` (1.0 for no rows), and
    the reference's :func:`top1_margins` at the steps where they differ. A flip where the
    reference itself was near a tie says the answer was fragile, not that the K/V was far."""
    _require_same_shape(reference_logits, logits)
    if len(reference_logits) == 0:
        return 1.0, []
    flipped = reference_logits.argmax(dim=-1) != logits.argmax(dim=-1)
    margins = top1_margins(reference_logits)[flipped]
    return 1.0 - float(flipped.double().mean()), [float(m) for m in margins]


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


def standard_error(values: Sequence[float]) -> float | None:
    """Standard error of the mean (sample standard deviation / sqrt(n)); None for fewer than
    two values."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    variance = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return (variance / len(values)) ** 0.5


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 0, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two equally long sequences (ties at their mean rank);
    None when either is constant or they hold fewer than two values."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} values against {len(b)}")
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else None


def recovered_fraction(value: float, worst: float, best: float) -> float | None:
    """How much of the gap from ``worst`` (naive reuse) to ``best`` (full prefill) ``value``
    closes: 0 = no better than naive reuse, 1 = as good as full prefill. None without a gap."""
    gap = best - worst
    if abs(gap) < 1e-12:
        return None
    return (value - worst) / gap
