"""A tiny end-to-end benchmark on the embedded model: JSON shape and sanity of the results."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from lmcache_backend.bench.arguments import add_arguments
from lmcache_backend.bench.cli import run
from lmcache_backend.config import load_config
from lmcache_backend.data.examples import builtin_examples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    pytest.importorskip("transformers")
    try:
        from lmcache_backend.data.embedded import embedded_gguf_path

        embedded_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    folder = tmp_path_factory.mktemp("bench")
    dataset = folder / "tiny.jsonl"
    with open(dataset, "w", encoding="utf-8") as fh:
        for ex in builtin_examples(count=2, chunks_per_example=3, seed=5):
            # Short chunks keep the test fast; the answers may be cut off, accuracy is not
            # what this test checks.
            chunks = [c[:220] for c in ex.chunks]
            row = dict(id=ex.id, system=ex.system, chunks=chunks, question=ex.question)
            fh.write(json.dumps(row | {"answers": ex.answers}) + "\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--dataset", str(dataset),
            "--repeats", "1",
            "--max-new-tokens", "4",
            "--ratios", "1.0",
            "--gradual", "none",
            "--epic-k", "4",
            "--prefix-block", "1",
            "--json", str(folder / "out" / "bench.json"),
            "--no-progress",
        ]
    )  # fmt: skip
    out = io.StringIO()
    # Short prompts have fewer reusable tokens than the default minimum for blending.
    run(args, config=load_config(enable_blending=True, blend_min_tokens=0), out=out)
    return json.loads((folder / "out" / "bench.json").read_text()), out.getvalue(), folder


def test_json_shape(result):
    data, _, _ = result
    assert set(data) >= {"setup", "args", "strategies", "examples", "sweep"}
    names = [r["strategy"] for r in data["strategies"]]
    assert names == ["full prefill", "prefix caching", "naive reuse", "CacheBlend r=1", "EPIC k=4"]
    for row in data["strategies"]:
        for key in ("ttft_ms", "ttft_ratio", "accuracy", "agreement", "kl", "token_layers_frac"):
            assert row[key] is not None, (row["strategy"], key)
    assert len(data["examples"]) == 2
    for case in data["examples"]:
        assert [o["strategy"] for o in case["outcomes"]] == names
        assert all(len(o["ttft_s"]) == 1 and o["ttft_s"][0] > 0 for o in case["outcomes"])
        assert all(isinstance(o["answer"], str) for o in case["outcomes"])
    assert data["sweep"] is None


def test_ratio_one_and_prefix_caching_match_full_prefill(result):
    data, _, _ = result
    rows = {r["strategy"]: r for r in data["strategies"]}
    for name in ("CacheBlend r=1", "prefix caching"):
        assert rows[name]["agreement"] == 1.0, name
        assert rows[name]["first_token_agreement"] == 1.0, name
        assert rows[name]["kl"] < 1e-3, (name, rows[name]["kl"])
    assert rows["full prefill"]["kl"] == 0.0
    assert rows["full prefill"]["token_layers_frac"] == 1.0


def test_reuse_really_reuses(result):
    data, _, _ = result
    for case in data["examples"]:
        outs = {o["strategy"]: o for o in case["outcomes"]}
        naive, prefix = outs["naive reuse"], outs["prefix caching"]
        assert naive["fallback_reason"] is None
        assert naive["reused_tokens"] > case["prompt_tokens"] // 2
        assert naive["recomputed_tokens"] < case["prompt_tokens"] // 2
        # Reordered chunks: only the system part is a common prefix.
        assert 0 < prefix["reused_tokens"] < case["prompt_tokens"] // 2
        assert naive["cache_bytes"] > 0 and outs["full prefill"]["cache_bytes"] == 0
    rows = {r["strategy"]: r for r in data["strategies"]}
    assert rows["naive reuse"]["kl"] > rows["CacheBlend r=1"]["kl"]


def test_table(result):
    _, printed, _ = result
    for name in ("full prefill", "prefix caching", "naive reuse", "CacheBlend r=1", "EPIC k=4"):
        assert name in printed
    assert "TTFT ms" in printed and "gap closed" in printed
