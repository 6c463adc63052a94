"""The Triton ``paged_attention_at_positions`` against the torch reference, on the cache views
the engines hand over: a contiguous ``[NB, BS, H, D]`` cache (NHD), the HND permutation of it, and
vLLM 0.26+'s ``[NB, H, BS, 2D]`` tensor read as ``transpose(1, 2).split(D, -1)``; blocks in a
shuffled order, unused blocks full of NaN (a read outside the table shows up). On the GPU when one
is visible, else on CPU tensors through Triton's interpreter (``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, assert_close

from lmcache_backend.ops import get_ops
from lmcache_backend.ops.reference import attention_at_positions, paged_attention_at_positions

pytest.importorskip("triton")

from lmcache_backend.backends.cuda.attention_tiling import AttentionTiling  # noqa: E402
from lmcache_backend.backends.cuda.paged_attention import (  # noqa: E402
    paged_attention_at_positions as paged_kernel,
)

BLOCK_SIZE = 16


def _caches(
    layout: str, num_blocks: int, heads: int, dim: int, dtype: torch.dtype, bs: int = BLOCK_SIZE
):
    """``(key_cache, value_cache)`` views ``[NB, BS, H, D]`` of one layer, NaN-filled."""
    nan = float("nan")
    if layout == "nhd":
        k = torch.full((num_blocks, bs, heads, dim), nan, dtype=dtype, device=DEVICE)
        return k, torch.full_like(k, nan)
    if layout == "hnd":  # memory [NB, H, BS, D]
        k = torch.full((num_blocks, heads, BLOCK_SIZE, dim), nan, dtype=dtype, device=DEVICE)
        v = torch.full_like(k, nan)
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    # vLLM 0.26+: logical [NB, H, BS, 2D] over memory [NB, BS, H, 2D]
    memory = torch.full((num_blocks, BLOCK_SIZE, heads, 2 * dim), nan, dtype=dtype, device=DEVICE)
    combined = memory.permute(0, 2, 1, 3)
    return combined.transpose(1, 2).split(dim, dim=-1)


def _fill(key_cache, value_cache, table, num_tokens: int, g: torch.Generator):
    """Random K/V for the request's tokens ``0..num_tokens-1`` through ``table``; returns them
    contiguous ``[T, H, D]``."""
    heads, dim, bs = key_cache.shape[2], key_cache.shape[3], key_cache.shape[1]
    keys = torch.randn(num_tokens, heads, dim, generator=g).to(key_cache.device, key_cache.dtype)
    values = torch.randn(num_tokens, heads, dim, generator=g).to(key_cache.device, key_cache.dtype)
    for t in range(num_tokens):
        block, row = int(table[t // bs]), t % bs
        key_cache[block, row] = keys[t]
        value_cache[block, row] = values[t]
    return keys, values


CASES = {
    "fp32-d32-gqa3": (torch.float32, 6, 2, 32, 70),
    "bf16-d128-gqa4": (torch.bfloat16, 8, 2, 128, 100),
    "fp16-d64-mha": (torch.float16, 2, 2, 64, 33),
}


@pytest.mark.parametrize("layout", ["nhd", "hnd", "split"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_the_reference(layout, case) -> None:
    dtype, heads, kv_heads, dim, num_tokens = CASES[case]
    g = torch.Generator().manual_seed(len(case) + len(layout))
    num_blocks = (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE + 3
    key_cache, value_cache = _caches(layout, num_blocks, kv_heads, dim, dtype)
    table = torch.randperm(num_blocks, generator=g)[: (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE]
    table = table.to(DEVICE)
    keys, values = _fill(key_cache, value_cache, table, num_tokens, g)
    positions = torch.tensor(
        sorted({0, 5, 17, num_tokens // 2, num_tokens - 2, num_tokens - 1}), device=DEVICE
    )
    q = torch.randn(positions.numel(), heads, dim, generator=g).to(DEVICE, dtype)
    ops = get_ops("cuda")  # compiled on the GPU, else Triton's interpreter (tests/conftest.py)
    args = (q, key_cache, value_cache, table, positions, dim**-0.5)
    assert ops.decline_reason("paged_attention_at_positions", *args) is None
    got = ops.paged_attention_at_positions(*args)
    want = attention_at_positions(q.float(), keys.float(), values.float(), positions, dim**-0.5)
    assert got.dtype == dtype and got.device.type == DEVICE and not torch.isnan(got).any()
    assert_close(got, want, dtype)
    assert_close(paged_attention_at_positions(*args), want, dtype)


@pytest.mark.parametrize("block_size", [1, 12, 32])
def test_other_block_sizes_match_the_reference(block_size) -> None:
    """The block size is a compile-time constant of the kernel: each one compiles its own
    division, a size that is not a power of two included."""
    g = torch.Generator().manual_seed(block_size)
    num_tokens, dim = 70, 32
    num_blocks = -(-num_tokens // block_size)
    key_cache, value_cache = _caches("nhd", num_blocks + 2, 2, dim, torch.float32, block_size)
    table = torch.randperm(num_blocks + 2, generator=g)[:num_blocks].to(DEVICE)
    keys, values = _fill(key_cache, value_cache, table, num_tokens, g)
    positions = torch.tensor([0, block_size, 33, 68, 69], device=DEVICE)
    q = torch.randn(positions.numel(), 4, dim, generator=g).to(DEVICE)
    ops = get_ops("cuda")
    args = (q, key_cache, value_cache, table, positions, dim**-0.5)
    assert ops.decline_reason("paged_attention_at_positions", *args) is None
    want = attention_at_positions(q, keys, values, positions, dim**-0.5)
    assert_close(ops.paged_attention_at_positions(*args), want, torch.float32)


def test_a_wrong_block_order_is_seen() -> None:
    """The same keys through a block table in another order give another answer (the test above
    cannot pass by ignoring the table)."""
    g = torch.Generator().manual_seed(3)
    key_cache, value_cache = _caches("nhd", 6, 2, 32, torch.float32)
    table = torch.tensor([4, 1, 3], device=DEVICE)
    _fill(key_cache, value_cache, table, 48, g)
    positions = torch.tensor([40, 47], device=DEVICE)
    q = torch.randn(2, 2, 32, generator=g).to(DEVICE)
    ops = get_ops("cuda")
    args = (q, key_cache, value_cache, table, positions, 0.2)
    assert ops.decline_reason("paged_attention_at_positions", *args) is None  # the kernel's answer
    right = ops.paged_attention_at_positions(*args)
    wrong = ops.paged_attention_at_positions(
        q, key_cache, value_cache, table.flip(0), positions, 0.2
    )
    assert not torch.allclose(right, wrong, atol=1e-3)


def test_declined_calls_name_the_reason() -> None:
    ops = get_ops("cuda")
    key_cache, value_cache = _caches("nhd", 2, 2, 32, torch.float32)
    q = torch.zeros(1, 2, 32, device=DEVICE)
    table, positions = torch.tensor([0, 1], device=DEVICE), torch.tensor([40], device=DEVICE)
    reason = ops.decline_reason(
        "paged_attention_at_positions", q, key_cache, value_cache, table, positions, 1.0
    )
    assert reason == "q_positions reach past the block table"
    bad = ops.decline_reason(
        "paged_attention_at_positions", q, key_cache.contiguous()[..., :24], value_cache,
        table, torch.tensor([1], device=DEVICE), 1.0,
    )  # fmt: skip
    assert "head dim" in bad


@pytest.mark.parametrize(
    "tiling",
    [
        AttentionTiling(32, 32, 4, 2, split=True),
        AttentionTiling(32, 32, 4, 2, heavy_first=True),
        AttentionTiling(32, 32, 4, 2, prefetch=True),
        AttentionTiling(32, 32, 4, 2, split=True, heavy_first=True, prefetch=True),
    ],
    ids=["split", "heavy-first", "prefetch", "all"],
)
def test_every_tiling_matches_the_reference(tiling) -> None:
    """Each tiling choice of the paged kernel, over shuffled blocks of the split (0.26+) view:
    queries spread over 200 tokens (tiles seen by every row, and diagonal ones), a group of 4."""
    g = torch.Generator().manual_seed(11)
    num_tokens, dim, kv_heads = 200, 32, 2
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    key_cache, value_cache = _caches("split", num_blocks + 3, kv_heads, dim, torch.float32)
    table = torch.randperm(num_blocks + 3, generator=g)[:num_blocks].to(DEVICE)
    keys, values = _fill(key_cache, value_cache, table, num_tokens, g)
    positions = torch.cat(
        [torch.randperm(199, generator=g)[:40].sort().values, torch.tensor([199])]
    )
    positions = positions.to(DEVICE)
    q = torch.randn(positions.numel(), 4 * kv_heads, dim, generator=g).to(DEVICE)
    got = paged_kernel(q, key_cache, value_cache, table, positions, dim**-0.5, tiling=tiling)
    want = attention_at_positions(q, keys, values, positions, dim**-0.5)
    assert_close(got, want, torch.float32)


def test_a_host_bound_on_the_positions_is_checked_without_reading_them() -> None:
    """``key_end`` (the caller's bound on every position + 1): the verifier checks the block
    table against it and reads nothing back from the device; the answer is the same."""
    from lmcache_backend.bench.profiling.launch_count import LaunchCounter

    g = torch.Generator().manual_seed(4)
    key_cache, value_cache = _caches("nhd", 6, 2, 32, torch.float32)
    table = torch.tensor([4, 1, 3], device=DEVICE)
    _fill(key_cache, value_cache, table, 48, g)
    positions = torch.tensor([40, 47], device=DEVICE)
    q = torch.randn(2, 2, 32, generator=g).to(DEVICE)
    ops = get_ops("cuda")
    args = (q, key_cache, value_cache, table, positions, 0.2)
    with LaunchCounter() as counter:
        reason = ops.decline_reason("paged_attention_at_positions", *args, key_end=48)
    assert reason is None and counter.counts.syncs == 0
    past = ops.decline_reason("paged_attention_at_positions", *args, key_end=49)
    assert past == "q_positions reach past the block table"
    torch.testing.assert_close(
        ops.paged_attention_at_positions(*args, key_end=48), ops.paged_attention_at_positions(*args)
    )
    # the reference reads the rows up to the bound: the same answer
    assert_close(
        paged_attention_at_positions(*args, key_end=48),
        ops.paged_attention_at_positions(*args),
        torch.float32,
    )
