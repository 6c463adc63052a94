"""Paged KV copies: the CPU layout derived through vLLM's own cache-write op, and a CUDA one.

Every recorded CUDA/Ascend form is checked against its backend's own read in
``test_vllm_layouts_contract.py``.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_backend.integration.vllm.layouts import (
    CpuLayout,
    derive_cpu_block_map,
    layout_for,
    slots_for,
)
from lmcache_backend.ops import get_ops

BLOCK_IDS = [7, 2, 5, 9]


def _kv(n: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, heads, dim, generator=g).to(dtype),
        torch.randn(n, heads, dim, generator=g).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads", [1, 3])
def test_cpu_layout_round_trips_through_vllm_op(dtype: torch.dtype, heads: int) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    block, dim = 32, 64
    isa = _get_attn_isa(dtype, block, dim, "auto")
    layout = CpuLayout(ops.cpu_attn_reshape_and_cache, isa, heads, block, dim, dtype)
    cache = torch.zeros(10, heads, block, 2 * dim, dtype=dtype)
    keys, values = _kv(100, heads, dim, dtype)
    slots = slots_for(BLOCK_IDS, block, 0, 100)
    layout.write(cache, keys, values, slots)
    got_k, got_v = layout.read(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    # untouched blocks stay zero: the op only wrote the request's blocks
    others = [b for b in range(10) if b not in BLOCK_IDS]
    assert not cache[others].ne(0).any()


def _naive_write(k, v, k_cache, v_cache, slots) -> None:
    bs = k_cache.shape[2]
    k_cache[slots // bs, :, slots % bs] = k
    v_cache[slots // bs, :, slots % bs] = v


def test_derivation_recovers_a_known_layout() -> None:
    m = derive_cpu_block_map(_naive_write, 2, 4, 8, torch.bfloat16)
    # naive: key (t, h, d) sits at h * (2 * bs * D) + t * D + d of the block
    t, h, d = 3, 1, 5
    assert int(m.key_offsets[t, h, d]) == h * 2 * 4 * 8 + t * 8 + d
    assert int(m.value_offsets[t, h, d]) == h * 2 * 4 * 8 + (4 + t) * 8 + d


def test_derivation_rejects_an_op_that_drops_elements() -> None:
    def lossy(k, v, k_cache, v_cache, slots) -> None:
        _naive_write(k, v, k_cache, v_cache, slots)
        k_cache[..., 0] = 0  # loses every key's first feature

    with pytest.raises(RuntimeError, match="key elements"):
        derive_cpu_block_map(lossy, 2, 4, 8, torch.float32)


@pytest.mark.parametrize("kv_first", [True, False], ids=["2xNB", "NBx2"])
def test_flash_layout_round_trip(kv_first: bool) -> None:
    heads, block, dim = 3, 16, 64
    shape = (2, 12, block, heads, dim) if kv_first else (12, 2, block, heads, dim)
    cache = torch.zeros(shape)
    layout = layout_for(
        cache, num_kv_heads=heads, head_dim=dim, block_size=block, ops=get_ops("torch")
    )
    keys, values = _kv(50, heads, dim, torch.float32)
    slots = slots_for(BLOCK_IDS, block, 0, 50)
    layout.write(cache, keys, values, slots)
    got_k, got_v = layout.read(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    k_cache, _ = layout.views(cache)
    assert torch.equal(k_cache[7, 3], keys[3])  # token 3 is row 3 of the first block (7)


def test_paged_attention_benchmark_times_the_three_query_sets() -> None:
    """``bench.profiling.paged_attention``: full prefill, scattered and clustered queries through
    vLLM's CPU attention op; the pair shares are the selections' query-key pairs over the full
    prefill's."""
    pytest.importorskip("vllm._custom_ops")
    from lmcache_backend.bench.profiling.paged_attention import measure

    row = measure(256, 0.25, 16, repeats=1)
    assert row["full pairs"] == 256 * 257 / 2
    for name in ("scattered", "runs of 8"):
        assert row[f"{name} ms"] > 0
        assert 0 < row[f"{name} pair share"] < 1
        assert row[f"{name} pairs"] == pytest.approx(row[f"{name} pair share"] * row["full pairs"])


def test_paged_attention_benchmark_times_spans_of_each_length() -> None:
    """``bench.profiling.paged_attention --spans``: per span length, the time and pair shares of a
    selection in aligned spans against a full prefill's."""
    pytest.importorskip("vllm._custom_ops")
    from lmcache_backend.backends.cpu.tiled_attention import unsupported_reason
    from lmcache_backend.bench.profiling.paged_attention import measure_spans

    shares = measure_spans(256, 0.25, [1, 8], 16, repeats=1)
    assert list(shares) == [1, 8]
    for time_share, pair_share, tiled_share in shares.values():
        assert time_share > 0 and 0 < pair_share < 1
        # the tiled kernel is timed where it runs, and only there
        assert (tiled_share is not None) == (unsupported_reason() is None)
        assert tiled_share is None or tiled_share > 0
