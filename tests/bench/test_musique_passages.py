"""``benchmarks/musique_passages.py``: the passage properties it measures, its rank correlation,
and a whole run over a bench JSON of the shipped MuSiQue development split."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from repo_paths import benchmark_module


@pytest.fixture(scope="module")
def script():
    return benchmark_module("musique_passages")


def test_spearman_ranks_with_ties_averaged(script):
    assert script.ranks([3.0, 1.0, 3.0, 2.0]) == [2.5, 0.0, 2.5, 1.0]
    assert script.spearman([1, 2, 3, 4], [10, 20, 25, 90]) == pytest.approx(1.0)
    assert script.spearman([1, 2, 3, 4], [9, 5, 2, 1]) == pytest.approx(-1.0)
    # Pearson's correlation of the ranks [0, 1, 2, 3] and [0.5, 0.5, 3, 2]
    assert script.spearman([1, 2, 3, 4], [7, 7, 9, 8]) == pytest.approx(0.7378647873726218)
    assert math.isnan(script.spearman([1, 1, 1], [1, 2, 3]))  # one side constant


def test_passage_properties_count_cut_starts_shared_and_asked_names(script):
    chunks = [
        "Qiang\n\n. qiang married vakhreva in moscow",
        "Kazan\n\n##tyevna vakhreva lived in kazan",
        "Volga\n\nthe river flows north",
    ]
    common = {"married": 9, "moscow": 9, "lived": 9, "river": 3, "flows": 9, "north": 9}
    df = Counter({"qiang": 1, "vakhreva": 2, "tyevna": 1, "kazan": 1, "volga": 1, **common})
    props = script.passage_properties(chunks, "Where did Vakhreva marry Qiang in Kazan?", df)
    assert props["cut_starts"] == 2  # a full stop, a WordPiece mark; "the river" is whole
    # rare words (df <= 2): {qiang, vakhreva}, {tyevna, vakhreva, kazan}, {volga}; vakhreva is
    # the one another passage also holds
    assert props["shared_names"] == pytest.approx((1 / 2 + 1 / 3 + 0 / 1) / 3)
    # asked: vakhreva, qiang, kazan and "marry", a word no passage holds (df 0, so rare)
    assert props["question_names"] == pytest.approx(3 / 4)


def test_a_run_prints_each_property_against_each_strategy(script, tmp_path, capsys):
    outcomes = [
        {"strategy": "full prefill", "answer_kl": 0.0, "fidelity_f1": 1.0},
        {"strategy": "naive reuse", "answer_kl": 0.1, "fidelity_f1": 0.5},
    ]
    cases = [
        {
            "id": f"musique-{i}",
            "outcomes": [dict(o, answer_kl=o["answer_kl"] * i) for o in outcomes],
        }
        for i in range(100, 104)
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"args": {"dataset": "musique@3"}, "examples": cases}))
    script.main([str(path)])
    printed = capsys.readouterr().out
    assert printed.startswith("4 examples of musique@3")
    assert printed.count("naive reuse") == 3  # one line per property
    path.write_text(json.dumps({"args": {"dataset": "musique@3"}, "examples": cases[:2]}))
    with pytest.raises(SystemExit, match="2 examples of musique@3; need at least 3"):
        script.main([str(path)])
