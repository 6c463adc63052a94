"""``benchmarks/device_blend.py`` (the hardware check's 8B-shaped blend on a GPU without vLLM)
at a tiny shape on CPU tensors, the kernels in Triton's interpreter: the same code path, every
recorded form it runs on the GPU. At ratio 1.0 the blended K/V and the last token's logits must
equal full prefill's within bf16's tolerance; the default ratio recomputes a share of the tokens
and stays close."""

from __future__ import annotations

import math

import pytest
from repo_paths import benchmark_module

pytest.importorskip("triton")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("device_blend")


@pytest.mark.slow
def test_the_tiny_shape_blends_like_full_prefill_on_every_form(bench) -> None:
    args = bench.parse_args(
        ["--shape", "tiny", "--device", "cpu", "--sizes", "300", "--chunk", "48", "--repeats", "1"]
    )
    result = bench.run(args)
    ratios = [(e["form"], e["ratio"]) for e in result["agreement"]]
    first = bench.FORMS[0]
    assert ratios == [(first, 1.0), (first, None), (first, 0.0)] + [
        (f, r) for f in bench.FORMS[1:] for r in (1.0, None)
    ]
    for entry in result["agreement"]:
        assert entry["stored"] >= 4, entry  # the system prompt and every chunk
        if entry["ratio"] == 1.0:
            # as close to the fp32 prefill as a bf16 full prefill (within the allowed factor)
            assert bench.agrees(entry), entry
            assert entry["bf16_kv_err_fp32"] > 0 and entry["token_layer_fraction"] >= 1.0, entry
        else:
            assert 0.0 < entry["token_layer_fraction"] < 0.6 or entry["ratio"] == 0.0, entry
            assert math.isfinite(entry["kv_rel_err"]) and entry["kl"] < 5e-2, entry
    # recomputing a fifth of the tokens moves the answer towards full prefill's
    default, naive = result["agreement"][1], result["agreement"][2]
    assert default["kv_rel_err"] < naive["kv_rel_err"], (default, naive)
    (timing,) = result["timing"]
    summary = bench.summary(timing)
    assert summary["rounds"] == 1 and summary["full_ms"] > 0 and summary["blend_ms"] > 0
    assert 0.0 < summary["recompute_fraction"] < 0.5
