"""Unit tests of the benchmark: dataset, strategies, metrics, aggregation (no model)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from lmcache_backend.bench.arguments import add_arguments
from lmcache_backend.bench.cli import strategies_from_args, sweep_points
from lmcache_backend.bench.datasets.dataset import (
    WARM_QUESTION,
    load_dataset,
    prompt_pair,
    sweep_example,
)
from lmcache_backend.bench.quality import engine_choice
from lmcache_backend.bench.quality.engine_choice import EngineUnavailable, create_engine
from lmcache_backend.bench.quality.engines import (
    common_prefix_length,
    epic_recompute_mask,
    reusable_prefix,
)
from lmcache_backend.bench.quality.metrics import (
    answer_correct,
    answers_agree,
    kl_divergence,
    median_ratio,
    recovered_fraction,
)
from lmcache_backend.bench.quality.report import format_table, summarize
from lmcache_backend.bench.quality.runner import CaseResult, StrategyOutcome, SweepPoint
from lmcache_backend.bench.quality.strategies import build_strategies, parse_schedule
from lmcache_backend.blend.segmenting import Segment
from lmcache_backend.data.examples import DatasetError, RagExample

GOOD = {"id": "a", "system": "s", "chunks": ["c1", "c2"], "question": "q?", "answers": ["x"]}


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# -- dataset ------------------------------------------------------------------------------


def test_dataset_reads_examples(tmp_path):
    second = dict(GOOD, id="b", chunks=["x", "y", "z"])
    path = _write(tmp_path, [json.dumps(GOOD), "", json.dumps(second)])
    examples = load_dataset(path)
    assert [e.id for e in examples] == ["a", "b"]
    assert examples[1].chunks == ["x", "y", "z"]


def test_builtin_dataset_default_count():
    examples = load_dataset(None)
    assert len(examples) == 12
    assert all(len(e.chunks) >= 3 for e in examples)


@pytest.mark.parametrize(
    "bad_line, field",
    [
        ("{not json", "not JSON"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "question"}), "'question'"),
        (json.dumps(dict(GOOD, answers="x")), "'answers'"),
        (json.dumps(dict(GOOD, chunks=["only one"])), "'chunks'"),
        (json.dumps(GOOD), "'id'"),  # a repeated id
    ],
    ids=["json", "missing-question", "answers-not-list", "one-chunk", "duplicate-id"],
)
def test_dataset_errors_name_line_and_field(tmp_path, bad_line, field):
    # Line 3 is the bad one; a blank line 2 must not shift the count.
    path = _write(tmp_path, [json.dumps(GOOD), "", bad_line])
    with pytest.raises(DatasetError) as err:
        load_dataset(path)
    assert f"{path}:3:" in str(err.value)
    assert field in str(err.value)


def test_prompt_pair_reorders_the_chunks_and_warms_with_another_question():
    example = RagExample("e", "S", ["a", "b", "c"], "Q", ["x"])

    def build(system, chunks, question):
        return [ord(ch) for ch in system + "".join(chunks) + question]

    pair = prompt_pair(build, example, seed=0)
    assert pair.warm_ids == [ord(c) for c in "Sabc" + WARM_QUESTION]
    assert pair.asked_ids == [ord(c) for c in "SbcaQ"]


def test_sweep_example_reaches_the_length_and_keeps_the_answer():
    words = lambda text: len(text.split())  # noqa: E731 - a stand-in tokenizer
    ex = sweep_example(words, target_tokens=2000, num_chunks=5)
    assert len(ex.chunks) == 5
    assert sum(words(c) for c in ex.chunks) >= 2000 - 60
    assert any(ex.answers[0] in c for c in ex.chunks)
    with pytest.raises(ValueError):
        sweep_example(words, 1000, 1)


# -- metrics ------------------------------------------------------------------------------


def test_kl_known_values():
    p = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    q = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-9)
    # KL is not symmetric: the reference distribution comes first.
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_divergence(q, p) == pytest.approx(reverse, rel=1e-9)
    # Shifting logits does not change the distribution.
    assert kl_divergence(p, p + 3.0) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        kl_divergence(p, torch.zeros(3))


def test_answer_metrics():
    assert answer_correct("It is  MARROWDALE.", ["Marrowdale"])
    assert answer_correct("plum   dumplings", ["Plum dumplings"])
    assert not answer_correct("Dunhollow", ["Marrowdale"])
    assert not answer_correct("anything", [" "])  # a blank gold answer matches nothing
    assert answers_agree(" The Cello ", "the  cello")
    assert not answers_agree("the cello", "the harp")


def test_ttft_ratio_is_median_of_pairs():
    times, full = [2.0, 10.0, 3.0], [1.0, 10.0, 1.0]
    # Pairs: 2, 1, 3 -> median 2; the ratio of the medians would be 3 / 1 = 3.
    assert median_ratio(times, full) == 2.0
    with pytest.raises(ValueError):
        median_ratio([1.0], [1.0, 2.0])


def test_recovered_fraction():
    assert recovered_fraction(0.5, 0.4, 0.8) == pytest.approx(0.25)
    assert recovered_fraction(0.1, 0.2, 0.0) == pytest.approx(0.5)  # KL: lower is better
    assert recovered_fraction(0.5, 0.5, 0.5) is None


# -- strategies and flags -------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_default_strategies():
    names = [s.name for s in strategies_from_args(_args())]
    assert names == [
        "full prefill",
        "prefix caching",
        "naive reuse",
        "CacheBlend r=0.05",
        "CacheBlend r=0.15",
        "CacheBlend r=0.3",
        "CacheBlend r=0.3,0.15 L=1,2",
        "EPIC k=16",
    ]


def test_strategy_flags():
    strategies = strategies_from_args(
        _args("--ratios", "0,0.5", "--check-layers", "2,4", "--gradual", "none", "--epic-k", "0")
    )
    assert [s.name for s in strategies] == [
        "full prefill",
        "prefix caching",
        "naive reuse",
        "CacheBlend r=0.5 L=2,4",
    ]
    assert strategies[-1].check_layers == (2, 4) and strategies[-1].ratios == (0.5,)
    two = strategies_from_args(_args("--gradual", "1,2:0.6,0.3", "--gradual", "1,3:0.3"))
    assert [s.check_layers for s in two[-3:-1]] == [(1, 2), (1, 3)]
    assert parse_schedule("1,2:0.3,0.15") == ((1, 2), (0.3, 0.15))
    for bad in ("1,2", "1,2:0.3,0.2,0.1", "a:0.1"):
        with pytest.raises(ValueError):
            parse_schedule(bad)
    with pytest.raises(SystemExit):
        _args("--ratios", "1.5")
    with pytest.raises(ValueError, match="given twice"):
        build_strategies(ratios=[0.15, 0.15])


def test_sweep_points_share_the_middle():
    by_len, by_chunks = sweep_points([1000, 4000, 2000], [3, 12, 6])
    assert by_len == [SweepPoint(1000, 6), SweepPoint(4000, 6), SweepPoint(2000, 6)]
    assert by_chunks == [SweepPoint(2000, 3), SweepPoint(2000, 12), SweepPoint(2000, 6)]


# -- engine helpers -------------------------------------------------------------------------


def test_prefix_helpers():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert reusable_prefix(common=37, num_tokens=100, block_size=16) == 32
    assert reusable_prefix(common=100, num_tokens=100, block_size=1) == 99  # last token computed
    assert reusable_prefix(common=15, num_tokens=100, block_size=16) == 0


def test_epic_mask():
    segments = [Segment(0, 5), Segment(5, 15), Segment(15, 18), Segment(18, 22)]
    mask = epic_recompute_mask(segments, 22, k=4)
    expected = torch.zeros(22, dtype=torch.bool)
    expected[5:9] = True  # first 4 of chunk 1
    expected[15:18] = True  # chunk 2 is shorter than k
    expected[18:] = True  # the question
    assert torch.equal(mask, expected)


def test_vllm_engine_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(engine_choice.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineUnavailable) as err:
        create_engine("vllm")
    message = str(err.value)
    assert "vLLM" in message and engine_choice.VLLM_CONNECTOR_MODULE in message
    with pytest.raises(EngineUnavailable, match="unknown engine"):
        create_engine("tgi")


# -- aggregation ----------------------------------------------------------------------------


def _case(cid, full_t, naive_t, naive_correct, tokens=100):
    return CaseResult(
        id=cid,
        prompt_tokens=tokens,
        num_chunks=3,
        answers=["x"],
        outcomes=[
            StrategyOutcome("full prefill", ttft_s=full_t, correct=True, agrees=True),
            StrategyOutcome(
                "naive reuse",
                ttft_s=naive_t,
                recomputed_tokens=10,
                kl=0.4,
                correct=naive_correct,
                agrees=naive_correct,
                fallback_reason=None,
            ),
        ],
    )


def test_summarize_pools_pairs_and_compares_with_naive():
    strategies = build_strategies(ratios=[], include_prefix=False, epic_k=0)
    cases = [_case("a", [1.0, 2.0], [0.5, 0.4], True), _case("b", [1.0, 1.0], [0.3, 0.9], False)]
    rows = summarize(cases, strategies)
    full, naive = rows
    # Pairs: 0.5, 0.2, 0.3, 0.9 -> median 0.4 (the medians' ratio would differ).
    assert naive["ttft_ratio"] == pytest.approx(0.4)
    assert naive["speedup"] == pytest.approx(2.6666666, rel=1e-6)
    assert naive["accuracy"] == 0.5 and full["accuracy"] == 1.0
    assert naive["accuracy_vs_full"] == 0.5 and full["accuracy_vs_full"] == 1.0
    assert naive["recomputed_frac"] == pytest.approx(0.1)
    assert naive["accuracy_recovered"] == 0.0 and full["accuracy_recovered"] == 1.0
    assert naive["kl_recovered"] == 0.0
    table = format_table(rows)
    assert "naive reuse" in table and "0.40x" in table


def test_profile_lists_the_costliest_operators_of_a_request(capsys) -> None:
    """``bench.profiling.profile --ops``: one request under the profiler, its operators by self
    time."""
    import torch

    from lmcache_backend.bench.profiling.profile import _operators, _print

    a = torch.randn(256, 256)
    ops = _operators(lambda: [torch.mm(a, a) for _ in range(3)], 2)
    assert ops[0]["op"] == "aten::mm" and ops[0]["calls"] == 3 and "256, 256" in ops[0]["shapes"]
    assert len(ops) == 2 and ops[0]["ms"] >= ops[1]["ms"]
    row = {
        "prompt_tokens": 10,
        "load_average": (0.0, 0.0, 0.0),
        "ttft_ms": {"full prefill": 1.0},
        "ratio_to_full": {"full prefill": 1.0},
        "token_layer_fraction": {"full prefill": 1.0},
        "full_us_per_token_layer": 1.0,
        "phases_ms": {"lookup": 1.0},
        "ops": ops,
    }
    _print(row, "CacheBlend 0.15")
    assert "aten::mm" in capsys.readouterr().out
