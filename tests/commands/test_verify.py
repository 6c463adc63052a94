"""``lmcache-backend verify`` (HF engine) on tiny models, and the RoPE table it relies on."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import build_tiny_model

from lmcache_backend.models.base import pure_rotation_table, rope_cos_sin_cache
from lmcache_backend.ops.reference import apply_rope, rope_rerotate_k


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_pure_rotation_table_rerotates_scaled_keys(is_neox) -> None:
    """A YaRN-style table (cos, sin times mscale): keys carry mscale once; the normalized
    table moves them to new positions without applying it again."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    mscale = 0.1 * math.log(4.0) + 1.0
    scaled = rope_cos_sin_cache(inv_freq, 512) * mscale
    k = torch.randn(40, 2, 64)
    old, new = torch.arange(40), torch.arange(40) + 300
    at_old, at_new = (apply_rope(k, p, scaled, is_neox) for p in (old, new))
    moved = rope_rerotate_k(at_old.clone(), old, new, pure_rotation_table(scaled), is_neox)
    torch.testing.assert_close(moved, at_new, rtol=1e-4, atol=1e-4)
    twice = rope_rerotate_k(at_old.clone(), old, new, scaled, is_neox)
    assert abs(twice.norm() / at_new.norm() - mscale**2) < 1e-3, "the unnormalized table scales"


@pytest.mark.parametrize(
    "rotary, attn, problem",
    [
        (SimpleNamespace(is_neox_style=True), SimpleNamespace(), "exposes no rotation table"),
        (
            type("MRotaryEmbedding", (), {"is_neox_style": True, "_compute_cos_sin_cache": 0})(),
            SimpleNamespace(),
            "not one rotation per position",
        ),
        (
            type("RotaryEmbedding", (), {"is_neox_style": True, "_compute_cos_sin_cache": 0})(),
            SimpleNamespace(do_llama_4_scaling=True),
            "llama_4_scaling",
        ),
    ],
    ids=["no-table", "mrope", "llama4-scaling"],
)
def test_unsupported_positional_encodings_are_refused(rotary, attn, problem) -> None:
    from lmcache_backend.models.vllm_layers import check_rotary

    with pytest.raises(ValueError, match=problem):
        check_rotary("MistralForCausalLM", attn, rotary)


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    return str(build_tiny_model("qwen3_yarn", tmp_path_factory.mktemp("yarn") / "m"))


def _verify(argv: list[str]) -> int:
    from lmcache_backend.cli import main

    return main(["verify", *argv, "--prompts", "1", "--max-tokens", "4"])


def test_verify_passes_on_a_yarn_model(yarn_model, capsys) -> None:
    assert _verify([yarn_model]) == 0
    out = capsys.readouterr().out
    assert "passed" in out and "FAIL" not in out, out
    assert "re-rotation error" in out and "ratio 1.0: greedy answers" in out, out


def test_verify_fails_when_rerotation_is_wrong(yarn_model, capsys, monkeypatch) -> None:
    """A table still holding an attention factor (the mistake YaRN invites) must fail."""
    import lmcache_backend.models.hf as hf

    monkeypatch.setattr(hf, "rope_cos_sin_cache", lambda f, n: rope_cos_sin_cache(f, n) * 1.14)
    assert _verify([yarn_model, "--json"]) == 1
    out = capsys.readouterr().out
    assert '"passed": false' in out, out
    import json

    checks = {c["name"]: c for c in json.loads(out.strip().splitlines()[-1])["checks"]}
    assert checks["re-rotation error"]["passed"] is False


def test_verify_on_start_takes_booleans_only() -> None:
    from lmcache_backend.config import ConfigError
    from lmcache_backend.settings import CONNECTOR

    key = CONNECTOR["verify_on_start"]
    assert key.value(True, "x") and key.value("on", "x")
    assert not key.value("false", "x")
    with pytest.raises(ConfigError, match=r"verify_on_start \(from x\) = 'maybe'"):
        key.value("maybe", "x")
