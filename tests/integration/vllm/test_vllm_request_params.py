"""Per-request ``kv_transfer_params``: a malformed value is logged and ignored, never raised."""

from __future__ import annotations

import logging

import pytest

from lmcache_backend.config import load_config
from lmcache_backend.integration.vllm.settings import request_config

NUM_LAYERS = 30


@pytest.fixture
def config():
    return load_config(enable_blending=True, blend_recompute_ratios=[0.15], blend_check_layers=[1])


def _schedule(cfg):
    return None if cfg is None else (cfg.blend_recompute_ratios, cfg.blend_check_layers)


@pytest.mark.parametrize(
    "params, expected",
    [
        (None, ([0.15], [1])),
        ({}, ([0.15], [1])),
        ({"blend": False}, None),
        ({"blend": True}, ([0.15], [1])),
        ({"blend_recompute_ratios": [1.0]}, ([1.0], [1])),
        (
            {"blend_recompute_ratios": [0.3, 0.1], "blend_check_layers": [1, 2]},
            ([0.3, 0.1], [1, 2]),
        ),
        ({"do_remote_prefill": True}, ([0.15], [1])),  # another connector's key: left alone
    ],
    ids=repr,
)
def test_valid_params(config, params, expected) -> None:
    assert _schedule(request_config(config, params, NUM_LAYERS, "r")) == expected


@pytest.mark.parametrize(
    "params, logged",
    [
        ({"blend_recompute_ratios": "x"}, "ratio 'x': could not convert"),
        ({"blend_recompute_ratios": [2.0]}, "ratio 2.0: expected a number in [0, 1]"),
        ({"blend_recompute_ratios": [float("nan")]}, "ratio nan: expected a number in [0, 1]"),
        ({"blend_recompute_ratios": {"a": 1}}, "(from kv_transfer_params) = {'a': 1}: expected a"),
        ({"blend_recompute_ratios": [0.1, 0.2, 0.3]}, "one ratio or one per check layer"),
        ({"blend_check_layers": [99]}, "layer 99 does not exist"),
        ({"blend_check_layers": [-1]}, ">= 0"),
        ({"blend_check_layers": [1.5]}, "not an integer"),
        ({"blend": "maybe"}, "expected true or false"),
        ({"blend": None}, "expected true or false"),
        ({"blend_ratio": 0.5}, "unknown kv_transfer_params ['blend_ratio']"),
        ("str", "expected a JSON object"),
        ([1], "expected a JSON object"),
    ],
    ids=repr,
)
def test_malformed_params_fall_back_to_the_engine_settings(config, params, logged, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.integration.vllm.settings"):
        out = request_config(config, params, NUM_LAYERS, "req-7")
    assert out is config, "the engine's settings apply"
    text = caplog.text
    assert "req-7" in text and logged in text, text


def test_blending_off_ignores_params() -> None:
    assert request_config(load_config(enable_blending=False), {"blend": "x"}, NUM_LAYERS) is None


def test_a_request_chooses_its_selection(config, caplog) -> None:
    chosen = request_config(config, {"blend_selection": "kv_deviation"}, NUM_LAYERS, "r")
    assert chosen.blend_selection == "kv_deviation"
    with caplog.at_level("WARNING"):
        kept = request_config(config, {"blend_selection": "bogus"}, NUM_LAYERS, "r2")
    assert kept.blend_selection == config.blend_selection
    assert "r2" in caplog.text and "blend_selection" in caplog.text


@pytest.mark.parametrize(
    "params",
    [
        {"blend_recompute_ratios": [0.5] * 1_000_000},  # one ratio per check layer expected
        {"blend_recompute_ratios": "9" * 1_000_000},
        {"blend": "x" * 1_000_000},
        {f"blend_{i}": 1 for i in range(100_000)},
        ["y" * 1_000_000],
    ],
    ids=["million-item list", "million-digit string", "long blend", "many keys", "long list"],
)
def test_a_huge_client_value_is_echoed_cut(config, params, caplog) -> None:
    """One request must not add megabytes to the log: every echoed value is cut."""
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.integration.vllm.settings"):
        out = request_config(config, params, NUM_LAYERS, "r" * 100_000)
    assert out is config
    assert caplog.records, "the bad value is still logged"
    for record in caplog.records:
        assert len(record.getMessage()) < 2_000, len(record.getMessage())
