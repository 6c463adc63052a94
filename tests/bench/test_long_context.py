"""Long-context variants of a dev set (``--dataset dev@16000``)."""

from __future__ import annotations

import pytest

from lmcache_backend.bench.datasets.dataset import load_dataset
from lmcache_backend.bench.datasets.devset import gold_chunk
from lmcache_backend.bench.datasets.long_context import (
    DEPTHS,
    _names,
    long_context_examples,
    split_length,
)
from lmcache_backend.data.examples import DatasetError


def _words(text: str) -> int:
    return len(text.split())


def test_dataset_names_take_a_length() -> None:
    assert split_length("dev@16000") == ("dev", 16000)
    assert split_length("/data/set.jsonl") == ("/data/set.jsonl", None)
    for bad in ("dev@", "dev@12k", "dev@500"):
        with pytest.raises(DatasetError, match=r"FILE@TOKENS"):
            split_length(bad)


@pytest.mark.parametrize("target", [2000, 6000])
def test_gold_kept_at_cycling_depths_among_distractors_of_other_people(target) -> None:
    base = load_dataset("dev")[:6]
    grown = long_context_examples(base, target, _words)
    for i, (ex, long) in enumerate(zip(base, grown)):
        gold = gold_chunk(ex)
        assert long.id == f"{ex.id}@{target}"
        assert (long.question, long.answers, long.system) == (ex.question, ex.answers, ex.system)
        assert gold_chunk(long) == gold and long.chunks.count(gold) == 1
        size = sum(map(_words, long.chunks)) + _words(ex.system) + _words(ex.question)
        assert target - 800 <= size <= target  # short of it by less than a chunk
        where = long.chunks.index(gold)
        assert where == round(DEPTHS[i % len(DEPTHS)] * (len(long.chunks) - 1))
        first, last = _names(gold)
        others = " ".join(c for c in long.chunks if c != gold)
        assert f" {first} " not in others and f" {last}" not in others
    assert grown == long_context_examples(base, target, _words)  # deterministic
