"""Triton K-deviation + top-k selection against the torch reference (GPU, or interpreter).

Selection compares float scores, so two summation orders could swap near-equal tokens at the
cut. The selection tests therefore use small integer-valued keys: every deviation is an exact
integer in fp32 whatever the order, so the kernel must return exactly the reference's indices,
ties included. Float deviations are checked separately against ``token_deviation``.
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, assert_close

from lmcache_backend.backends.cuda.deviation import masked_token_deviation
from lmcache_backend.ops import get_ops
from lmcache_backend.ops.reference import token_deviation

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def integer_keys(num_tokens: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    """Fresh and cached keys with integer entries in [-4, 4] (exact in every dtype) and a mask."""
    gen = torch.Generator().manual_seed(seed)
    fresh = torch.randint(-4, 5, (num_tokens, *shape), generator=gen).to(DEVICE, dtype)
    cached = torch.randint(-4, 5, (num_tokens, *shape), generator=gen).to(DEVICE, dtype)
    valid = torch.rand(num_tokens, generator=gen).to(DEVICE) < 0.7
    return fresh, cached, valid


def select_both(k_fresh, k_cached, valid, ratio, num_reusable=None) -> torch.Tensor:
    """Kernel result (checking it is not declined), asserted equal to the reference's."""
    args = (k_fresh, k_cached, valid, ratio, num_reusable)
    cuda = get_ops("cuda")
    assert get_ops("cuda").verifiers["kv_deviation_topk"](*args) is None
    result = cuda.kv_deviation_topk(*args)
    expected = get_ops("torch").kv_deviation_topk(*args)
    assert result.dtype == torch.int64 and result.device.type == DEVICE
    assert torch.equal(result, expected), f"{result.tolist()} != {expected.tolist()}"
    return result


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens", [1, 63, 4097])
def test_selection_matches_reference(num_tokens, dtype):
    fresh, cached, valid = integer_keys(num_tokens, (2, 64), dtype, seed=num_tokens)
    selected = select_both(fresh, cached, valid, 0.15)
    # Every invalid token is kept, plus int(0.15 * n_valid) valid ones (at least one).
    assert set((~valid).nonzero().flatten().tolist()) <= set(selected.tolist())
    num_valid = int(valid.sum())
    assert int(valid[selected].sum()) == min(max(int(0.15 * num_valid), 1), num_valid)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_ratio_extremes(ratio):
    fresh, cached, valid = integer_keys(63, (2, 64), torch.float16, seed=6)
    selected = select_both(fresh, cached, valid, ratio)
    assert int(valid[selected].sum()) == int(ratio * int(valid.sum()))


@pytest.mark.parametrize("num_reusable", [None, 5, 40, 1000], ids=lambda n: f"reusable{n}")
def test_num_reusable_sets_the_base(num_reusable):
    fresh, cached, valid = integer_keys(63, (256,), torch.bfloat16, seed=7)
    selected = select_both(fresh, cached, valid, 0.3, num_reusable)
    num_valid = int(valid.sum())
    base = num_valid if num_reusable is None else num_reusable
    expected_valid = min(max(int(0.3 * base), 1), num_valid)
    assert int(valid[selected].sum()) == expected_valid


@pytest.mark.parametrize("layout", ["3d", "2d"])
def test_flat_and_head_layouts(layout):
    fresh, cached, valid = integer_keys(63, (4, 64), torch.float16, seed=8)
    if layout == "2d":
        fresh, cached = fresh.view(63, 256), cached.view(63, 256)
    select_both(fresh, cached, valid, 0.2)


def test_strided_views_of_larger_buffers():
    """Keys as slices of fused buffers (row stride larger than the row) are read in place."""
    fresh_buf, cached_buf, valid = integer_keys(63, (3 * 128,), torch.float32, seed=9)
    fresh = fresh_buf[:, 128:256]
    cached = cached_buf[:, :128]
    assert not fresh.is_contiguous()
    select_both(fresh, cached, valid, 0.25)


def test_transposed_keys_are_copied_then_served():
    fresh, cached, valid = integer_keys(63, (64, 2), torch.float32, seed=10)
    select_both(fresh.transpose(1, 2), cached.transpose(1, 2), valid, 0.25)


def test_ties_break_like_the_reference():
    # Many identical deviations: both must keep the same tokens of a tie.
    fresh = torch.zeros(63, 2, 64, device=DEVICE)
    cached = torch.zeros(63, 2, 64, device=DEVICE)
    cached[::3] = 1.0
    valid = torch.ones(63, dtype=torch.bool, device=DEVICE)
    select_both(fresh, cached, valid, 0.1)


def test_no_valid_token_keeps_everything():
    fresh, cached, _ = integer_keys(63, (64,), torch.float32, seed=11)
    valid = torch.zeros(63, dtype=torch.bool, device=DEVICE)
    selected = select_both(fresh, cached, valid, 0.5)
    assert selected.tolist() == list(range(63))


def test_ratio_zero_all_valid_selects_nothing():
    fresh, cached, _ = integer_keys(63, (64,), torch.float32, seed=12)
    valid = torch.ones(63, dtype=torch.bool, device=DEVICE)
    selected = select_both(fresh, cached, valid, 0.0)
    assert selected.numel() == 0


def test_empty_input():
    fresh = torch.empty(0, 2, 64, device=DEVICE)
    args = (fresh, fresh.clone(), torch.empty(0, dtype=torch.bool, device=DEVICE), 0.5)
    cuda = get_ops("cuda")
    assert get_ops("cuda").verifiers["kv_deviation_topk"](*args) is None
    selected = cuda.kv_deviation_topk(*args)
    assert selected.dtype == torch.int64 and selected.shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens", [1, 63, 4097])
def test_float_deviation_values(num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    fresh = torch.randn(num_tokens, 2, 128, generator=gen).to(DEVICE, dtype)
    cached = torch.randn(num_tokens, 2, 128, generator=gen).to(DEVICE, dtype)
    valid = torch.rand(num_tokens, generator=gen).to(DEVICE) < 0.7
    scores = masked_token_deviation(fresh, cached, valid)
    expected = token_deviation(fresh, cached)
    assert scores.dtype == torch.float32 and scores.shape == (num_tokens,)
    assert torch.all(scores[~valid] == float("-inf"))
    # fp32 math on both sides: only the summation order differs.
    assert_close(scores[valid], expected[valid], torch.float32)
