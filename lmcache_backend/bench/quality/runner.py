"""Run strategies over examples (quality and TTFT) and over prompt sizes (TTFT sweep)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmcache_backend.bench.datasets.dataset import (
    WARM_QUESTION,
    PromptPair,
    prompt_pair,
    sweep_example,
)
from lmcache_backend.bench.quality.engines import BenchEngine, PrefillRun
from lmcache_backend.bench.quality.metrics import (
    answer_correct,
    answer_f1,
    answer_span,
    answers_agree,
    first_line,
    forced_flips,
    kl_divergence,
    mean_kl,
    median_ratio,
    top1_margins,
)
from lmcache_backend.bench.quality.strategies import FULL, Strategy
from lmcache_backend.data.examples import RagExample

Progress = Callable[[int], None]

#: how the store is filled before an example is asked: ``request`` (an earlier request with the
#: chunks in order stored them, each computed after the chunks before it) or ``ingest`` (each
#: chunk computed alone after the system part, as ``lmcache-backend ingest`` does)
WARM_MODES = ("request", "ingest")


@dataclass
class StrategyOutcome:
    """One strategy on one prompt."""

    strategy: str
    ttft_s: list[float] = field(default_factory=list)
    ttft_ratio: float = 1.0  # median over rounds of this run's TTFT / full prefill's
    recomputed_tokens: int = 0
    token_layers_frac: float = 1.0
    reused_tokens: int = 0
    kl: float = 0.0
    first_token_agrees: bool = True
    answer: str | None = None
    correct: bool | None = None
    agrees: bool | None = None
    #: the CacheBlend paper's F1 of the answer against full prefill's answer (fidelity) and
    #: against the gold answers (the best one)
    fidelity_f1: float | None = None
    gold_f1: float | None = None
    #: mean KL(full || strategy) over full prefill's answer tokens, teacher-forced
    answer_kl: float | None = None
    #: along the same forced answer: the share of tokens whose top-1 is full prefill's, and
    #: full prefill's top-1 margin (log-prob, best minus second) at every token of its answer
    #: (full prefill itself) or at the tokens where this strategy's top-1 differs (the others)
    answer_top1_agreement: float | None = None
    margins: list[float] | None = None
    cache_bytes: int | None = 0
    fallback_reason: str | None = None
    #: what the recomputed tokens held of the question's reads (preview selections)
    read_share: float | None = None
    #: the blend's divergence estimate (preview selections)
    divergence: float | None = None

    @property
    def ttft_ms(self) -> float:
        return 1000 * statistics.median(self.ttft_s)


@dataclass
class CaseResult:
    """Every strategy on one prompt."""

    id: str
    prompt_tokens: int
    num_chunks: int
    answers: list[str]
    outcomes: list[StrategyOutcome]
    #: seconds spent filling the store before the example was asked (staleness probes included)
    warm_s: float = 0.0

    def outcome(self, name: str) -> StrategyOutcome:
        return next(o for o in self.outcomes if o.strategy == name)


def _untimed_pass(
    engine: BenchEngine,
    strategies: Sequence[Strategy],
    pair: PromptPair,
    max_new_tokens: int,
    tick: Progress,
) -> list[StrategyOutcome]:
    """One run of each strategy, not timed: it warms caches and allocators, and its logits and
    greedy answers are the quality numbers (the timed runs compute the same thing).

    With ``max_new_tokens`` > 0 each strategy also answers greedily, and its distributions along
    full prefill's answer (the tokens of its first line, which the F1 reads) are taken with
    that answer teacher-forced (:meth:`BenchEngine.forced_logits`)."""
    tokens, num_layers = pair.asked_ids, engine.num_layers
    outcomes, runs = [], []
    span: list[int] = []  # full prefill's answer, its first line
    full_text = ""
    reference: torch.Tensor | None = None  # full prefill's logits along ``span``
    for strategy in strategies:
        run: PrefillRun = engine.prefill(strategy, tokens, timed=False)
        runs.append(run)
        outcome = StrategyOutcome(
            strategy=strategy.name,
            ttft_s=[run.ttft_s],
            recomputed_tokens=run.recomputed_tokens,
            token_layers_frac=run.token_layers / (len(tokens) * num_layers),
            reused_tokens=run.reused_tokens,
            cache_bytes=engine.cache_bytes(strategy),
            fallback_reason=run.fallback_reason,
            read_share=run.read_share,
            divergence=run.divergence,
        )
        if max_new_tokens > 0:
            answer = engine.decode(tokens, run, max_new_tokens)
            outcome.answer = answer.text.strip()
            outcome.correct = answer_correct(outcome.answer, pair.example.answers)
            outcome.gold_f1 = max(
                (answer_f1(answer.text, gold, engine.encode) for gold in pair.example.answers),
                default=None,
            )
            if reference is None:  # full prefill, the first strategy
                span = answer_span(answer.token_ids, engine.decode_ids)
                reference = engine.forced_logits(tokens, run, span)
                full_text = first_line(answer.text)  # the reference is graded text too
            is_reference = run is runs[0]
            forced = reference if is_reference else engine.forced_logits(tokens, run, span)
            outcome.fidelity_f1 = answer_f1(answer.text, full_text, engine.encode)
            outcome.answer_kl = mean_kl(reference, forced) if span else None
            if span:
                outcome.answer_top1_agreement, flips = forced_flips(reference, forced)
                outcome.margins = top1_margins(reference).tolist() if is_reference else flips
        outcomes.append(outcome)
        run.state = None  # free the K/V
        tick(1)
    first = runs[0].logits
    for outcome, run in zip(outcomes, runs):
        outcome.kl = kl_divergence(first, run.logits)
        outcome.first_token_agrees = int(run.logits.argmax()) == int(first.argmax())
        if max_new_tokens > 0:
            outcome.agrees = answers_agree(outcome.answer or "", outcomes[0].answer or "")
            if outcome.answer_kl is None:  # full prefill's answer is empty: its first token
                outcome.answer_kl = outcome.kl
    return outcomes


def _timed_rounds(
    engine: BenchEngine,
    strategies: Sequence[Strategy],
    tokens: Sequence[int],
    outcomes: list[StrategyOutcome],
    repeats: int,
    tick: Progress,
) -> None:
    """``repeats`` rounds; each round runs every strategy once, so a strategy's TTFT is compared
    with full prefill's from the same round. The order rotates each round so that no strategy
    always runs right after another particular one."""
    n = len(strategies)
    if repeats == 0 and outcomes:
        full = outcomes[0].ttft_s
        for outcome in outcomes:
            outcome.ttft_ratio = median_ratio(outcome.ttft_s, full)
        return
    for r in range(repeats):
        for i in range(n):
            j = (i + r) % n
            outcomes[j].ttft_s.append(engine.prefill(strategies[j], tokens).ttft_s)
            tick(1)
    full = outcomes[0].ttft_s
    for outcome in outcomes:
        outcome.ttft_ratio = median_ratio(outcome.ttft_s, full)


def _check_strategies(strategies: Sequence[Strategy]) -> None:
    if not strategies or strategies[0].kind != FULL:
        raise ValueError("the first strategy must be full prefill (the reference)")


def run_case(
    engine: BenchEngine,
    strategies: Sequence[Strategy],
    example: RagExample,
    repeats: int,
    max_new_tokens: int,
    seed: int = 0,
    tick: Progress = lambda n: None,
    warm: str = "request",
    probe_contexts: Sequence[Sequence[str]] = (),
) -> CaseResult:
    """Fill the caches from ``example`` (:data:`WARM_MODES`: its chunks in their original order,
    or each chunk alone), then answer it reordered with every strategy: one untimed pass
    (quality), then ``repeats`` timed rounds. ``repeats=0`` measures quality only; the TTFT
    columns then come from the untimed pass (first runs, not a timing).

    With ``probe_contexts`` (``ingest`` only), each chunk stored alone is then computed after
    each probe context (other passages) as a staleness probe, and its entry gets the prior
    (:meth:`BenchEngine.probe`), as ``lmcache-backend ingest --staleness-probes`` does."""
    _check_strategies(strategies)
    if repeats < 0:
        raise ValueError(f"repeats must be >= 0, got {repeats}")
    if warm not in WARM_MODES:
        raise ValueError(f"warm {warm!r} is not one of {', '.join(WARM_MODES)}")
    pair = prompt_pair(engine.prompt_ids, example, seed)
    engine.reset()
    started = time.perf_counter()
    if warm == "ingest":  # the prompt lmcache-backend ingest computes for each chunk
        for chunk in example.chunks:
            engine.warm(engine.prompt_ids(example.system, [chunk], WARM_QUESTION))
        for chunk in example.chunks if probe_contexts else ():
            for context in probe_contexts:
                probe = engine.prompt_ids(example.system, [*context, chunk], WARM_QUESTION)
                engine.probe(probe, len(probe_contexts))
    else:
        engine.warm(pair.warm_ids)
    warm_s = time.perf_counter() - started
    outcomes = _untimed_pass(engine, strategies, pair, max_new_tokens, tick)
    if repeats:
        for outcome in outcomes:
            outcome.ttft_s.clear()  # the untimed pass's first runs do not count
    _timed_rounds(engine, strategies, pair.asked_ids, outcomes, repeats, tick)
    return CaseResult(
        id=example.id,
        prompt_tokens=len(pair.asked_ids),
        num_chunks=len(example.chunks),
        answers=list(example.answers),
        outcomes=outcomes,
        warm_s=warm_s,
    )


def probe_contexts(
    examples: Sequence[RagExample], index: int, count: int, per_context: int = 2
) -> list[list[str]]:
    """``count`` probe contexts for example ``index``: ``per_context`` passages each, from the
    examples after it in turn (none of its own passages), as an ingest samples other documents
    of its corpus."""
    own = set(examples[index].chunks)
    contexts: list[list[str]] = []
    for step in range(1, len(examples)):
        if len(contexts) == count:
            break
        other = [c for c in examples[(index + step) % len(examples)].chunks if c not in own]
        if len(other) >= per_context:
            contexts.append(other[:per_context])
    return contexts


def steps_per_case(strategies: Sequence[Strategy], repeats: int) -> int:
    """Progress steps of one :func:`run_case` (one per prefill)."""
    return len(strategies) * (1 + repeats)


def run_examples(
    engine: BenchEngine,
    strategies: Sequence[Strategy],
    examples: Sequence[RagExample],
    repeats: int,
    max_new_tokens: int,
    tick: Progress = lambda n: None,
    warm: str = "request",
    probes: int = 0,
) -> list[CaseResult]:
    """:func:`run_case` for every example; example ``i`` is reordered with seed ``i``; with
    ``probes`` (``ingest`` only) each chunk gets a staleness prior from that many probe
    contexts (:func:`probe_contexts`)."""
    return [
        run_case(
            engine,
            strategies,
            ex,
            repeats,
            max_new_tokens,
            seed=i,
            tick=tick,
            warm=warm,
            probe_contexts=probe_contexts(examples, i, probes) if probes else (),
        )
        for i, ex in enumerate(examples)
    ]


@dataclass(frozen=True)
class SweepPoint:
    """A prompt size of the sweep: about ``tokens`` prompt tokens in ``chunks`` chunks."""

    tokens: int
    chunks: int


def run_sweep(
    engine: BenchEngine,
    strategies: Sequence[Strategy],
    points: Sequence[SweepPoint],
    repeats: int,
    tick: Progress = lambda n: None,
) -> list[CaseResult]:
    """TTFT (and first-token KL) of every strategy at each prompt size; no decoding."""
    cases = []
    for point in points:
        example = sweep_example(engine.count_tokens, point.tokens, point.chunks)
        cases.append(run_case(engine, strategies, example, repeats, 0, seed=0, tick=tick))
    return cases
