"""The framework clients' bench without a server: the stats-file reader, the summary, the flags."""

from __future__ import annotations

import argparse
import json

import pytest

from lmcache_backend.bench.frameworks import clients
from lmcache_backend.bench.frameworks.common import Answer, StatsFile, reuse_of


def test_a_line_without_blended_is_a_blend() -> None:
    reuse = reuse_of([{"req_id": "r", "num_tokens": 200, "num_reusable": 150}])
    assert reuse.seen and reuse.blended and reuse.share == 0.75 and reuse.req_id == "r"


def test_a_line_with_blended_false_is_not_a_blend_and_says_why() -> None:
    reuse = reuse_of([{"blended": False, "reason": "too few reusable tokens", "num_tokens": 9}])
    assert reuse.seen and not reuse.blended and reuse.share == 0.0
    assert reuse.reason == "too few reusable tokens"


def test_a_fallback_is_not_a_blend() -> None:
    reuse = reuse_of([{"num_tokens": 100, "num_reusable": 90, "fallback_reason": "store miss"}])
    assert reuse.seen and not reuse.blended and reuse.reason == "store miss"


def test_no_line_is_not_seen() -> None:
    assert not reuse_of([]).seen


def test_a_request_gets_the_lines_written_while_it_runs(tmp_path) -> None:
    path = tmp_path / "blend.jsonl"
    path.write_text(json.dumps({"num_tokens": 1, "num_reusable": 1}) + "\n")
    stats = StatsFile(path)

    def send() -> Answer:
        with open(path, "a") as fh:
            fh.write(json.dumps({"blended": True, "num_tokens": 10, "num_reusable": 6}) + "\n")
        return Answer("ok", 0.1, 0.2)

    answer, reuse = stats.around(send)
    assert answer.text == "ok" and reuse.blended and reuse.share == 0.6
    _, none = stats.around(lambda: Answer("ok", 0.1, 0.2))
    assert not none.seen
    assert not StatsFile(None).around(lambda: Answer("", 1, 1))[1].seen


def _call(blended: bool, ttft: float, correct: bool, share: float = 0.8) -> dict:
    reuse = {
        "blended": blended,
        "seen": blended,
        "share": share if blended else 0.0,
        "reason": None,
    }
    return {"answer": {"ttft_s": ttft}, "reuse": reuse, "correct": correct}


def test_summary_and_table() -> None:
    rows = [
        {
            "reordered": {
                "blend": _call(True, 0.3, True),
                "full": _call(False, 1.0, True),
                "ratio": 0.3,
            },
            "new_document": {
                "blend": _call(True, 0.5, False),
                "full": _call(False, 1.0, True),
                "ratio": 0.5,
            },
        },
        {
            "reordered": {
                "blend": _call(False, 1.0, False),
                "full": _call(False, 1.0, True),
                "ratio": 1.0,
            },
            "new_document": {
                "blend": _call(True, 0.9, True),
                "full": _call(False, 1.0, True),
                "ratio": 0.9,
            },
        },
    ]
    s = clients.summarize(rows)
    assert (s["prompts"], s["blended"], s["new_document_blended"]) == (2, 1, 2)
    assert s["reused_share"] == pytest.approx(0.4) and s["ttft_ratio"] == pytest.approx(0.65)
    assert s["new_document_max_ratio"] == 0.9
    assert (s["correct_blend"], s["correct_full"]) == (1, 2)
    assert "1/2" in clients.format_table({"langchain-stock": s})


def test_shapes_of_a_client() -> None:
    args = argparse.Namespace(client="langchain", shapes=None)
    assert clients._shapes(args) == ["langchain-stock", "langchain-one-message"]
    args.shapes = "llamaindex-chat"
    with pytest.raises(SystemExit, match="no shapes"):
        clients._shapes(args)


def test_every_new_document_is_another_examples() -> None:
    examples, extras = clients.pick_examples(None, 3, 4)
    ids = [e.id for e in examples] + [e.id for group in extras for e in group]
    assert len(ids) == len(set(ids)) == 15
    with pytest.raises(SystemExit, match="--examples"):
        clients.pick_examples(None, 100, 4)


def test_the_new_document_is_the_one_the_question_is_about() -> None:
    from lmcache_backend.data.examples import RagExample

    examples, _ = clients.pick_examples(None, 3, 1)
    for ex in examples:  # the dev set: the profile named in the question
        name = clients.new_document(ex).split(".", 1)[0].removeprefix("Profile of ")
        assert name in ex.question
    other = RagExample("x", "s", ["no", "the answer is Teal", "no"], "Colour?", ["teal"])
    assert clients.new_document(other) == "the answer is Teal"
