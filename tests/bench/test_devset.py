"""The shipped quality dev set and its generator."""

from __future__ import annotations

import pytest

from lmcache_backend.bench.dataset import load_dataset
from lmcache_backend.bench.devset import DEVSET_PATH, calibrate, candidates, gold_chunk
from lmcache_backend.data.examples import builtin_examples


def test_shipped_devset_has_enough_distinct_examples() -> None:
    examples = load_dataset("dev")
    assert len(examples) >= 100
    assert len({ex.id for ex in examples}) == len(examples)
    builtin_chunks = {c for ex in builtin_examples(count=12) for c in ex.chunks}
    for ex in examples:
        assert 4 <= len(ex.chunks) <= 6
        gold = gold_chunk(ex)
        assert any(answer in gold for answer in ex.answers)
        assert sum(gold.split(".")[0] == c.split(".")[0] for c in ex.chunks) == 1
        assert not builtin_chunks & set(ex.chunks)  # another seed than the built-in set


def test_shipped_devset_is_the_first_candidates_that_calibrate() -> None:
    """Every shipped example is a candidate of the generator, in the generator's order."""
    shipped = load_dataset(str(DEVSET_PATH))
    pool = {ex.id: ex for ex in candidates(int(shipped[-1].id.split("-")[1]) + 1)}
    ids = [ex.id for ex in shipped]
    assert ids == sorted(ids)
    for ex in shipped:
        assert pool[ex.id] == ex


def test_calibrate_keeps_examples_answered_from_gold_only() -> None:
    pool = candidates(6)
    gold_of = {ex.question: gold_chunk(ex) for ex in pool}
    knows = {pool[1].question}  # the model "guesses" this one without context

    def answer(system: str, chunks: list[str], question: str) -> str:
        ex = next(e for e in pool if e.question == question)
        if question in knows or chunks == [gold_of[question]]:
            return f"It is {ex.answers[0]}."
        return "I do not know."

    kept = calibrate(pool, answer)
    assert [ex.id for ex in kept] == [ex.id for ex in pool if ex.question not in knows]
    assert len(calibrate(pool, answer, want=2)) == 2


@pytest.mark.slow
def test_first_shipped_examples_calibrate_on_the_embedded_model() -> None:
    from lmcache_backend.bench.devset import hf_answer

    shipped = load_dataset("dev")[:3]
    assert calibrate(shipped, hf_answer()) == shipped
