"""The scheduler side decides per request, before claiming, whether blending pays, and records
every request it leaves to vLLM once, with its reason (log line and stats-file line)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from fake_vllm_config import vllm_config

from lmcache_backend.blend.pays import estimate_blend
from lmcache_backend.config import load_config
from lmcache_backend.models.fingerprint import ModelFingerprint

FP = ModelFingerprint("LlamaForCausalLM", 30, 9, 3, 64, "theta=1e5", "bfloat16", "test")
LAYERS = 30


def test_estimate_counts_what_each_phase_computes() -> None:
    config = load_config(env={}, blend_recompute_ratios=[0.2])
    # 1,000 tokens, all but the 40-token tail reused: preview and engine compute the tail,
    # the blend 20% of the reused tokens
    full_reuse = estimate_blend(1000, 0, 960, 960, config, LAYERS)
    assert full_reuse.cost_share == pytest.approx((40 + 40 + 0.2 * 960) / 1000)
    assert full_reuse.fresh == 0 and full_reuse.reused_share == pytest.approx(0.96)
    # the same claim with 300 tokens the store lacks: they are computed once, in every layer
    holes = estimate_blend(1000, 0, 960, 660, config, LAYERS)
    assert holes.fresh == 300
    assert holes.cost_share == pytest.approx((40 + 300 + 0.2 * 660 + 40) / 1000)
    # vLLM's prefix hit is computed by neither: the share is of the tokens a prefill computes
    prefixed = estimate_blend(1000, 200, 960, 760, config, LAYERS)
    assert prefixed.cost_share == pytest.approx((40 + 0.2 * 760 + 40) / 800)
    # a check-layer selection computes every claimed token up to its first check layer
    kv = load_config(env={}, blend_selection="kv_deviation", blend_recompute_ratios=[0.2])
    check = estimate_blend(1000, 0, 960, 960, kv, LAYERS)
    assert check.cost_share == pytest.approx((2 * 960 + 28 * 0.2 * 960 + 30 * 40) / 30000)


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.integration.vllm.scheduler_side.scheduler import SchedulerSide
    from lmcache_backend.integration.vllm.settings import load_settings

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    try:
        path = str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    extra = {
        "enable_blending": True,
        "blend_min_tokens": 64,
        "stats_file": str(tmp_path / "stats.jsonl"),
        "extra_config": {"segment_index_dir": str(tmp_path / "index")},
    }
    side = SchedulerSide(load_settings(vllm_config(path, extra, LAYERS)), FP, profile=None)
    yield side
    side.shutdown()


def _hold(side, tokens: list[int], upto: int) -> None:
    """Put the aligned blocks of ``tokens[:upto]`` in the scheduler's index."""
    from lmcache_backend.storage.lookup.index import FileSegmentIndex
    from lmcache_backend.storage.segments import segment_keys

    pattern = side.settings.separator
    units = [s for s in pattern.store_units(tokens) if s.end <= upto]
    index = FileSegmentIndex(side.settings.config.extra_config["segment_index_dir"])
    for key in segment_keys(FP, tokens, [(s.start, s.end) for s in units]):
        index.add(key)


def _lines(side) -> list[dict]:
    with open(side.settings.stats_file, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _request(rid: str, tokens: list[int], params=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, kv_transfer_params=params)


def test_every_unclaimed_request_is_recorded_once_with_its_reason(scheduler) -> None:
    side = scheduler
    tokens = list(range(1000, 1800))  # 800 tokens, nothing marks chunks: blocks of 16
    # nothing stored yet; vLLM may ask again while the request waits: one line
    assert side.num_new_matched_tokens(_request("a", tokens), 0) == 0
    assert side.num_new_matched_tokens(_request("a", tokens), 0) == 0
    # opted out
    assert side.num_new_matched_tokens(_request("b", tokens, {"blend": False}), 0) == 0
    # the first 48 tokens held: below blend_min_tokens=64
    _hold(side, tokens, 48)
    assert side.num_new_matched_tokens(_request("c", tokens), 0) == 0
    # the first 320 held, then 480 new tokens: the preview and vLLM would both compute them
    _hold(side, tokens, 320)
    tail = tokens[:320] + list(range(5000, 5480))
    assert side.num_new_matched_tokens(_request("d", tail), 0) == 0
    lines = _lines(side)
    assert [(x["req_id"], x["reason"]) for x in lines] == [
        ("a", "no reusable span"),
        ("b", "opted out"),
        ("c", "below blend_min_tokens"),
        ("d", "would not pay"),
    ]
    assert all(x["blended"] is False and x["num_tokens"] == 800 for x in lines)
    assert lines[2]["num_reusable"] == 48 and lines[3]["predicted_cost_share"] > 1.0
    assert side.stats.skipped == {
        "no reusable span": 1,
        "opted out": 1,
        "below blend_min_tokens": 1,
        "would not pay": 1,
    }


def test_new_text_inside_the_claim_is_claimed_only_while_it_pays(scheduler) -> None:
    side = scheduler
    tokens = list(range(1000, 1800))
    _hold(side, tokens, 800)
    # everything but the last block reused: claimed up to the end of the last block found
    assert side.num_new_matched_tokens(_request("all", tokens), 0) == 784
    # a new 300-token document in the middle: computed once in the blend, still pays
    middle = tokens[:240] + list(range(5000, 5300)) + tokens[540:]
    assert side.num_new_matched_tokens(_request("some", middle), 0) > 0
    # a new 450-token one: more than blend_max_cost of a full prefill, left to vLLM
    more = tokens[:160] + list(range(6000, 6450)) + tokens[610:]
    assert side.num_new_matched_tokens(_request("more", more), 0) == 0
    (line,) = _lines(side)
    assert line["req_id"] == "more" and line["reason"] == "would not pay"
    assert line["predicted_cost_share"] > side.settings.config.blend_max_cost
    assert "blend_max_cost=0.6" in line["detail"]


def test_a_request_with_its_own_settings_is_claimed_whatever_the_cost(scheduler) -> None:
    """``kv_transfer_params`` blend settings (e.g. ratio 1.0 to check exactness) ask for that
    blend: only blend_min_tokens applies."""
    side = scheduler
    tokens = list(range(1000, 1800))
    _hold(side, tokens, 800)
    assert side.num_new_matched_tokens(_request("one", tokens), 0) == 784
    own = {"blend_recompute_ratios": [1.0]}
    assert side.num_new_matched_tokens(_request("exact", tokens, own), 0) == 784
    more = tokens[:160] + list(range(6000, 6450)) + tokens[610:]
    assert side.num_new_matched_tokens(_request("more", more, own), 0) > 0
    assert not os.path.exists(side.settings.stats_file)
