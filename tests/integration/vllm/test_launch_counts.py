"""What the connector's device path asks of the device per layer, counted op by op on the path
``benchmarks/device_blend.py`` and the connector's worker take (a tiny Llama on CPU tensors, the
kernels in Triton's interpreter): launches per layer and per segment, and host-device syncs inside
the layer loop, against full prefill counted the same way.

Per layer means the difference between the same request on a 4-layer and a 2-layer model,
halved: what a request does once cancels out. Per segment per layer is the same difference
between prompts of 9 and 6 chunks.
"""

from __future__ import annotations

import pytest
import torch
from repo_paths import benchmark_module

pytest.importorskip("triton")
pytest.importorskip("transformers")

DEPTHS = (2, 4)
CHUNKS = (6, 9)
CHUNK = 48
#: eager launches per layer of a blend (its preview and its blend pass) against full prefill's
LAUNCH_FACTOR = 2.5


@pytest.fixture(scope="module")
def counts() -> dict:
    bench = benchmark_module("device_blend")
    setup, checks = benchmark_module("device_blend_setup"), benchmark_module("device_blend_checks")
    from lmcache_backend.ops import get_ops

    get_ops("cuda")
    base = setup.SHAPES["tiny"]
    out = {}
    for depth in DEPTHS:
        shape = setup.Shape(**{**base.__dict__, "layers": depth})
        model = setup.build_model(shape, "cpu", torch.bfloat16)
        prompts = {
            c: setup.rag_prompts(setup.SYSTEM + setup.QUESTION + c * (CHUNK + 2), 2, shape.vocab,
                                 seed=c, chunk=CHUNK)
            for c in CHUNKS
        }  # fmt: skip
        longest = max(len(p) for warm, asked in prompts.values() for p in [warm, *asked])
        runner = setup.Bench(model, setup.find_form(bench.FORMS[0]), longest, "cuda")
        try:
            for c, (warm, asked) in prompts.items():
                assert runner.store(warm) == c + 1  # the system part and every chunk
                runner.blend(asked[0], None, "warm-up")
                out[depth, c] = checks.counted(runner, asked[1])
        finally:
            runner.close()
    return out


def _per_layer(counts: dict, chunks: int, mode: str, what: str) -> float:
    deep, shallow = (counts[d, chunks][mode][what] for d in reversed(DEPTHS))
    return (deep - shallow) / (DEPTHS[1] - DEPTHS[0])


@pytest.mark.slow
def test_no_host_device_sync_inside_the_layer_loop(counts) -> None:
    deep, shallow = (counts[d, CHUNKS[0]]["CacheBlend"] for d in reversed(DEPTHS))
    extra = {
        site: n - shallow["sync_sites"].get(site, 0)
        for site, n in deep["sync_sites"].items()
        if n != shallow["sync_sites"].get(site, 0)
    }
    assert _per_layer(counts, CHUNKS[0], "CacheBlend", "syncs") == 0, extra


@pytest.mark.slow
def test_no_launches_per_segment_and_layer(counts) -> None:
    per_layer = [_per_layer(counts, c, "CacheBlend", "launches") for c in CHUNKS]
    assert per_layer[0] == per_layer[1], per_layer


@pytest.mark.slow
def test_launches_per_layer_within_a_few_times_full_prefill(counts) -> None:
    blend = _per_layer(counts, CHUNKS[0], "CacheBlend", "launches")
    full = _per_layer(counts, CHUNKS[0], "full prefill", "launches")
    assert 0 < full and blend <= LAUNCH_FACTOR * full, (blend, full)
