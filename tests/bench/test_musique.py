"""The CacheBlend paper's MuSiQue set (``--dataset musique``: the shipped file, or files written
here in its format), its F1, the teacher-forced KL's mean and where forced answers flip."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from lmcache_backend.bench.datasets import musique
from lmcache_backend.bench.datasets.dataset import load_dataset
from lmcache_backend.bench.quality.metrics import (
    answer_f1,
    answer_span,
    first_line,
    forced_flips,
    mean_kl,
    squad_normalize,
    top1_margins,
)
from lmcache_backend.data.examples import DatasetError


def _paper_file(path, count=3, passages=10):
    rows = [
        {
            "question": f"Who founded town {i}",
            "answers": [f"Founder {i}"],
            "ctxs": [
                {"title": "" if j else f"T{i}", "text": f" passage {i}.{j} text "}
                for j in range(passages)
            ],
        }  # fmt: skip
        for i in range(count)
    ]
    path.write_text(json.dumps(rows))
    return path


def test_paper_file_is_posed_as_the_paper_poses_it(tmp_path):
    path = _paper_file(tmp_path / "m.json")
    examples = load_dataset(f"{path}@3")
    assert [e.id for e in examples] == ["musique-0", "musique-1", "musique-2"]
    ex = examples[1]
    assert ex.system == musique.PAPER_INSTRUCTION
    # a title goes before its text after a blank line, as in the paper's doc prompt
    assert ex.chunks == ["T1\n\npassage 1.0 text", "passage 1.1 text", "passage 1.2 text"]
    assert ex.question == musique.PAPER_QUERY + "who founded town 1?\nAnswer:"
    assert ex.answers == ["Founder 1"]
    assert len(load_dataset(str(path))[0].chunks) == 10  # all passages by default


def test_named_splits_read_the_shipped_file():
    dev = load_dataset("musique")
    assert [e.id for e in dev][:2] == ["musique-100", "musique-101"] and len(dev) == 50
    assert len(dev[0].chunks) == 10
    # the paper's question template around the file's question, and its gold answer
    assert dev[0].question.endswith(
        "Question:who is the father of Empress Wang's husband?\nAnswer:"
    )
    assert dev[0].answers == ["Yang Xingmi"]
    held_out = load_dataset("musique-heldout@2")
    assert len(held_out) == 100 and held_out[-1].id == "musique-99"
    assert len(held_out[0].chunks) == 2
    assert {e.question for e in dev}.isdisjoint(e.question for e in held_out)


def test_compressed_file_and_unreadable_file(tmp_path):
    path = _paper_file(tmp_path / "m.json")
    packed = tmp_path / "m.json.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert load_dataset(f"{packed}@2") == load_dataset(f"{path}@2")
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(DatasetError, match="cannot read .*bad.json.gz"):
        load_dataset(str(tmp_path / "bad.json.gz"))
    with pytest.raises(DatasetError, match="cannot read .*missing.json"):
        load_dataset(str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    ("suffix", "message"), [("@1", "@PASSAGES from 2 to 10"), ("@x", "@PASSAGES"), ("@11", "10")]
)
def test_bad_passage_counts_name_the_value(tmp_path, suffix, message):
    path = _paper_file(tmp_path / "m.json")
    with pytest.raises(DatasetError, match=message):
        load_dataset(f"{path}{suffix}")


def test_malformed_file_names_the_entry(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"question": "q", "answers": ["a"]}]))
    with pytest.raises(DatasetError, match="entry 0 is not in the paper's format"):
        load_dataset(str(path))
    path.write_text("{}")
    with pytest.raises(DatasetError, match="JSON list"):
        load_dataset(str(path))


def _chars(text):
    return [ord(c) for c in text]


def test_paper_f1():
    # the first line only, SQuAD-normalized (case, punctuation, articles)
    assert answer_f1("The Beatles.\nMore text", "beatles", _chars) == 1.0
    assert first_line("\n\nyes, it is") == "Yes" and first_line("No way") == "No"
    assert squad_normalize("An  Apple, the pie!") == "apple pie"
    # token F1: "ab" vs "abcd" by characters: precision 1, recall 0.5
    assert answer_f1("ab", "abcd", _chars) == pytest.approx(2 / 3)
    assert answer_f1("xy", "ab", _chars) == 0.0
    assert answer_f1("", "", _chars) == 1.0 and answer_f1("", "b", _chars) == 0.0


def test_answer_span_ends_with_the_first_line():
    decode = "".join  # one character per token
    assert answer_span(list("Paris\nThe"), decode) == list("Paris\n")
    assert answer_span(list("\nParis"), decode) == list("\nParis")  # leading newline skipped
    assert answer_span(list("Paris"), decode) == list("Paris")


def test_mean_kl_averages_rows():
    ref = torch.tensor([[0.0, 0.0], [5.0, 0.0]])
    assert mean_kl(ref, ref) == 0.0
    other = torch.tensor([[0.0, 0.0], [0.0, 5.0]])
    assert mean_kl(ref, other) == pytest.approx(torch.nn.functional.kl_div(
        torch.log_softmax(other[1], -1), torch.log_softmax(ref[1], -1),
        log_target=True, reduction="sum").item() / 2)  # fmt: skip
    assert mean_kl(ref[:0], ref[:0]) == 0.0


def test_top1_margins_are_the_log_prob_gap_of_the_two_best_tokens():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, -3.0], [-1.0, 4.0, 1.0]])
    log_p = torch.log_softmax(logits.double(), -1)
    assert top1_margins(logits).tolist() == pytest.approx(
        [float(log_p[0, 0] - log_p[0, 1]), 0.0, float(log_p[2, 1] - log_p[2, 2])]
    )
    assert top1_margins(logits).tolist() == pytest.approx([2.0, 0.0, 3.0])  # shift-invariant


def test_forced_flips_counts_changed_top_choices_and_keeps_the_reference_margins():
    ref = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    other = torch.tensor([[2.0, 0.0, 0.0], [0.6, 0.5, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 0.0]])
    agreement, margins = forced_flips(ref, other)
    assert agreement == 0.5  # rows 1 and 2 changed their top token
    assert margins == pytest.approx([0.5, 1.0])  # full prefill's own gaps there, in row order
    assert forced_flips(ref, ref) == (1.0, [])
    assert forced_flips(ref[:0], ref[:0]) == (1.0, [])
    with pytest.raises(ValueError, match="shapes differ"):
        forced_flips(ref, other[:2])
