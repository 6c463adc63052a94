"""The shipped quality dev set and its generator."""

from __future__ import annotations

import pytest

from lmcache_backend.bench.datasets.dataset import load_dataset
from lmcache_backend.bench.datasets.devset import (
    DEVSET_PATH,
    calibrate,
    candidates,
    devset_path,
    gold_chunk,
    prompt_shape_for,
)
from lmcache_backend.data.examples import DatasetError, builtin_examples

MODELS = [None, "gemma3-270m"]  # the embedded models, each with a dev set of its own


@pytest.mark.parametrize("model", MODELS)
def test_shipped_devset_has_enough_distinct_examples(model) -> None:
    examples = load_dataset("dev", model=model)
    assert len(examples) >= 100
    assert len({ex.id for ex in examples}) == len(examples)
    builtin_chunks = {c for ex in builtin_examples(count=12) for c in ex.chunks}
    for ex in examples:
        assert 4 <= len(ex.chunks) <= 6
        gold = gold_chunk(ex)
        assert any(answer in gold for answer in ex.answers)
        assert sum(gold.split(".")[0] == c.split(".")[0] for c in ex.chunks) == 1
        assert not builtin_chunks & set(ex.chunks)  # another seed than the built-in set


@pytest.mark.parametrize("model", MODELS)
def test_shipped_devset_is_the_first_candidates_that_calibrate(model) -> None:
    """Every shipped example is a candidate of the generator, in the generator's order."""
    shipped = load_dataset(str(devset_path(model)))
    pool = {ex.id: ex for ex in candidates(int(shipped[-1].id.split("-")[1]) + 1)}
    ids = [ex.id for ex in shipped]
    assert ids == sorted(ids)
    for ex in shipped:
        assert pool[ex.id] == ex


def test_each_embedded_model_has_its_own_devset_and_prompt_shape(tmp_path) -> None:
    assert devset_path(None) == DEVSET_PATH
    assert devset_path("gemma3-270m").name == "devset-gemma3-270m.jsonl"
    assert load_dataset("dev", model="gemma3-270m") != load_dataset("dev")
    assert (prompt_shape_for(None), prompt_shape_for("gemma3-270m")) == ("separator", "text")
    assert prompt_shape_for(str(tmp_path)) == "separator"  # a model folder of the user's
    with pytest.raises(DatasetError, match=r"--model .*bench.datasets.devset --model"):
        load_dataset("dev", model=str(tmp_path))


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
@pytest.mark.parametrize("model", MODELS)
def test_first_shipped_examples_calibrate_on_the_embedded_model(model) -> None:
    from lmcache_backend.bench.datasets.devset import hf_answer

    shipped = load_dataset("dev", model=model)[:3]
    assert calibrate(shipped, hf_answer(model_name=model)) == shipped
