"""The benchmark's run, table, JSON and plots over a fake engine (no model: fast, exact)."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch

from lmcache_backend.bench.arguments import add_arguments
from lmcache_backend.bench.cli import run
from lmcache_backend.bench.quality.engines import Answer, PrefillRun
from lmcache_backend.bench.quality.strategies import BLEND, EPIC, FULL, PREFIX

VOCAB = 8


class FakeEngine:
    """Characters as tokens; a strategy's first-token logits drift from full prefill's as less
    is recomputed, and its TTFT is proportional to what it computes."""

    name = "fake"
    model_name = "fake-model"
    num_layers = 4

    def __init__(self) -> None:
        self.warmed: list[list[int]] = []
        self.resets = 0

    def describe(self):
        return {"engine": "fake", "model": self.model_name, "dtype": "float32",
                "ops_backend": "none", "threads": 1, "num_layers": self.num_layers}  # fmt: skip

    def prompt_ids(self, system, chunks, question):
        return [ord(c) for c in system + "|" + "|".join(chunks) + "|" + question]

    def count_tokens(self, text):
        return len(text)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode_ids(self, token_ids):
        return "".join(chr(t) for t in token_ids)

    def supports(self, strategy):
        return strategy.kind != EPIC

    def reset(self):
        self.resets += 1
        self.warmed.clear()

    def warm(self, token_ids):
        self.warmed.append(list(token_ids))

    def prefill(self, strategy, token_ids, timed=True):
        assert self.warmed, "prefill before warm"
        n = len(token_ids)
        share = {FULL: 1.0, PREFIX: 1.0, BLEND: strategy.final_ratio or 0.0}[strategy.kind]
        logits = torch.arange(VOCAB, dtype=torch.float32)
        # Below ratio 0.5 the answer changes: the greedy token moves from 7 to 0.
        logits[0] += 10.0 * (1 - share)
        computed = max(1, int(share * n))
        return PrefillRun(logits, 0.001 * computed, computed, computed * self.num_layers,
                          n - computed, None, logits)  # fmt: skip

    def decode(self, token_ids, run, max_new_tokens):
        text = f"answer {int(run.logits.argmax())}\nmore"
        return Answer(text, self.encode(text))

    def forced_logits(self, token_ids, run, answer_ids):
        return run.logits.expand(len(answer_ids), VOCAB)

    def cache_bytes(self, strategy):
        return 0 if strategy.kind == FULL else 1024 * 1024


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {
            "id": f"e{i}",
            "system": "S",
            "chunks": ["aaaa", "bbbbbb", "cc"],
            "question": "Q?",
            "answers": ["answer 7"],
        }  # fmt: skip
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_run_json_table_and_plots(tmp_path, dataset):
    pytest.importorskip("matplotlib")
    engine = FakeEngine()
    args = _parse(
        "--dataset", str(dataset), "--repeats", "2", "--ratios", "0.25,0.75",
        "--sweep", "--sweep-tokens", "2000,8000", "--sweep-chunks", "2,4", "--sweep-repeats", "1",
        "--json", str(tmp_path / "j" / "r.json"), "--plots", str(tmp_path / "p"), "--no-progress",
    )  # fmt: skip
    out = io.StringIO()
    run(args, out=out, engine=engine)
    data = json.loads((tmp_path / "j" / "r.json").read_text())
    rows = {r["strategy"]: r for r in data["strategies"]}
    assert list(rows) == [
        "full prefill", "prefix caching", "naive reuse", "CacheBlend r=0.25", "CacheBlend r=0.75",
        "CacheBlend r=0.3,0.15 L=1,2",
    ]  # fmt: skip
    assert "cannot run: EPIC k=16" in out.getvalue()
    # 3 prompts + 3 distinct sweep sizes ((2000,4), (8000,4), (8000,2)), each reset and warmed once.
    assert engine.resets == 6
    assert rows["full prefill"]["accuracy"] == 1.0 and rows["prefix caching"]["agreement"] == 1.0
    assert rows["naive reuse"]["accuracy"] == 0.0 and rows["naive reuse"]["kl"] > 1.0
    assert rows["CacheBlend r=0.75"]["accuracy"] == 1.0
    assert rows["CacheBlend r=0.75"]["accuracy_recovered"] == 1.0
    assert rows["CacheBlend r=0.25"]["accuracy_recovered"] == 0.0
    assert 0 < rows["CacheBlend r=0.25"]["kl_recovered"] < 1
    # fidelity: the paper's F1 against full prefill's answer ("answer 7" vs "answer 0": 7 of 8
    # characters), and the teacher-forced KL along full prefill's first line ("answer 7\n")
    assert rows["full prefill"]["fidelity_f1"] == 1.0 and rows["full prefill"]["answer_kl"] == 0
    assert rows["CacheBlend r=0.75"]["fidelity_f1"] == 1.0
    assert rows["CacheBlend r=0.75"]["answer_kl"] == pytest.approx(rows["CacheBlend r=0.75"]["kl"])
    assert rows["CacheBlend r=0.25"]["fidelity_f1"] == pytest.approx(7 / 8)
    assert rows["CacheBlend r=0.25"]["answer_kl"] == pytest.approx(rows["CacheBlend r=0.25"]["kl"])
    assert rows["full prefill"]["gold_f1"] == 1.0
    # forced top-1: r=0.25 picks 0 where full prefill picks 7 (whose lead over 6 is 1 logit)
    assert rows["full prefill"]["answer_top1_agreement"] == 1.0
    assert rows["full prefill"]["margin_median"] == pytest.approx(1.0)  # over its own answer
    assert rows["CacheBlend r=0.75"]["answer_top1_agreement"] == 1.0
    assert rows["CacheBlend r=0.75"]["margin_median"] is None  # no flips
    assert rows["CacheBlend r=0.25"]["answer_top1_agreement"] == 0.0
    assert rows["CacheBlend r=0.25"]["margin_median"] == pytest.approx(1.0)  # at the flips
    assert "F1/full" in out.getvalue() and "ans KL" in out.getvalue()
    # TTFT is proportional to the computed tokens: the ratio is the share (floored).
    assert rows["CacheBlend r=0.75"]["ttft_ratio"] == pytest.approx(0.75, abs=0.06)
    assert rows["full prefill"]["cache_bytes"] == 0
    assert len(data["examples"]) == 3
    assert all(len(o["ttft_s"]) == 2 for c in data["examples"] for o in c["outcomes"])
    sweep = data["sweep"]
    assert [c["num_chunks"] for c in sweep["by_length"]] == [4, 4]
    assert [c["num_chunks"] for c in sweep["by_chunks"]] == [2, 4]
    assert sweep["by_length"][0]["prompt_tokens"] < sweep["by_length"][1]["prompt_tokens"]
    printed = out.getvalue()
    assert "TTFT by context length" in printed and "TTFT by number of chunks" in printed
    pngs = sorted(p.name for p in (tmp_path / "p").glob("*.png"))
    assert pngs == [
        "accuracy_vs_ratio.png",
        "frontier.png",
        "ttft_vs_chunks.png",
        "ttft_vs_context_length.png",
    ]


def test_bad_flags_stop_with_a_message(tmp_path, dataset):
    with pytest.raises(SystemExit, match=r"blend_check_layers \(from --check-layers\) = \[9\]"):
        run(_parse("--dataset", str(dataset), "--check-layers", "9", "--no-progress"),
            out=io.StringIO(), engine=FakeEngine())  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        run(_parse("--dataset", str(bad), "--no-progress"), out=io.StringIO(), engine=FakeEngine())


def test_repeats_zero_measures_quality_only(dataset):
    engine = FakeEngine()
    calls = []
    prefill = engine.prefill
    engine.prefill = lambda s, t, timed=True: calls.append(timed) or prefill(s, t, timed)
    args = _parse("--dataset", str(dataset), "--repeats", "0", "--ratios", "0.75", "--gradual",
                  "none", "--no-progress")  # fmt: skip
    result = run(args, out=io.StringIO(), engine=engine)
    assert calls and not any(calls)  # only the untimed quality pass ran
    rows = {r["strategy"]: r for r in result["strategies"]}
    assert rows["CacheBlend r=0.75"]["accuracy"] == 1.0 and rows["naive reuse"]["kl"] > 1.0
    assert all(len(o["ttft_s"]) == 1 for c in result["examples"] for o in c["outcomes"])
    with pytest.raises(SystemExit, match="--repeats must be >= 0"):
        run(_parse("--dataset", str(dataset), "--repeats", "-1", "--no-progress"),
            out=io.StringIO(), engine=FakeEngine())  # fmt: skip


def test_warm_ingest_stores_each_chunk_alone_after_the_system_part(dataset):
    """``--warm ingest``: one prompt per chunk, the one ``lmcache-backend ingest`` computes."""
    from lmcache_backend.bench.datasets.dataset import WARM_QUESTION

    for mode, expected in (
        ("request", [["aaaa", "bbbbbb", "cc"]]),
        ("ingest", [["aaaa"], ["bbbbbb"], ["cc"]]),
    ):
        engine = FakeEngine()
        args = _parse("--dataset", str(dataset), "--repeats", "0", "--gradual", "none",
                      "--limit", "1", "--warm", mode, "--no-progress")  # fmt: skip
        result = run(args, out=io.StringIO(), engine=engine)
        assert engine.warmed == [engine.prompt_ids("S", c, WARM_QUESTION) for c in expected]
        assert result["args"]["warm"] == mode


def test_warm_auto_stores_musique_chunks_alone_and_both_settings_give_two_row_sets(dataset):
    """``--warm auto`` (the default) fills the store as ``ingest`` does for the MuSiQue sets
    and from an earlier request for the others; ``ingest,request`` runs every strategy under
    both fillings, its rows named by the setting."""
    from lmcache_backend.bench.arguments import warm_modes

    assert warm_modes("auto", "musique@3") == ["ingest"]
    assert warm_modes("auto", "musique-heldout") == ["ingest"]
    assert warm_modes("auto", "dev") == ["request"]
    assert warm_modes("auto", None) == ["request"]
    assert warm_modes("request,ingest", "musique") == ["request", "ingest"]
    engine = FakeEngine()
    out = io.StringIO()
    args = _parse("--dataset", str(dataset), "--repeats", "0", "--gradual", "none",
                  "--limit", "2", "--ratios", "0.75", "--warm", "ingest,request",
                  "--no-progress")  # fmt: skip
    result = run(args, out=out, engine=engine)
    assert result["warm"] == ["ingest", "request"]
    names = [r["strategy"] for r in result["strategies"]]
    assert names[:2] == ["full prefill [ingest]", "prefix caching [ingest]"]
    assert names.count("naive reuse [request]") == 1 and len(names) == 8
    assert [r["warm"] for r in result["strategies"]] == ["ingest"] * 4 + ["request"] * 4
    assert [c["warm"] for c in result["examples"]] == ["ingest", "ingest", "request", "request"]
    naive = result["strategies"][2]
    assert naive["fidelity_f1_se"] == 0.0 and naive["answer_kl_se"] == 0.0  # the same on each
    printed = out.getvalue()
    assert "0.875±0.000" in printed
    assert printed.index("chunks stored by ingest") < printed.index("chunks stored by an earlier")
    for bad in ("ingest,ingest", "auto,request", "disk", ""):
        with pytest.raises(SystemExit):
            _parse("--dataset", str(dataset), "--warm", bad)


def test_rows_carry_standard_errors_of_fidelity_and_answer_kl():
    """``F1/full`` and ``ans KL`` come with their standard error over prompts."""
    from lmcache_backend.bench.quality.metrics import standard_error

    assert standard_error([1.0]) is None and standard_error([]) is None
    assert standard_error([0.0, 1.0]) == pytest.approx(0.5)
    assert standard_error([0.2, 0.4, 0.9]) == pytest.approx(0.2081666, rel=1e-6)
