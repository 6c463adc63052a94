"""Triton selected-query attention against the torch reference (on the GPU, or the interpreter).

The reference builds the exact ``key <= position`` mask and runs SDPA in fp32; the kernel must
agree within the storage dtype's tolerance. Key counts stay small because the interpreter runs
each tile in numpy.
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, assert_close, nan_like

from lmcache_backend.backends.cuda.attention import attention_at_positions
from lmcache_backend.backends.cuda.attention_tiling import AttentionTiling, fit_grid
from lmcache_backend.ops import get_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (query heads, KV heads): GQA ratios 1, 3 and 8.
HEADS = [
    pytest.param((4, 4), id="gqa1"),
    pytest.param((6, 2), id="gqa3"),
    pytest.param((8, 1), id="gqa8"),
]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_inputs(num_k, heads, head_dim, dtype, seed, num_q=None):
    """Random q/k/v and sorted distinct query positions (15% of keys by default, plus the last)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    k = torch.randn(num_k, hkv, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_k, hkv, head_dim, generator=gen).to(DEVICE, dtype)
    if num_q is None:
        num_q = max(1, num_k * 15 // 100)
    positions = torch.randperm(num_k - 1, generator=gen).to(DEVICE)[: num_q - 1]
    # The last token is always recomputed.
    positions = torch.cat([positions.sort().values, torch.tensor([num_k - 1], device=DEVICE)])
    q = torch.randn(positions.shape[0], hq, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k, v, positions


def attend_both(q, k, v, positions, scale):
    """Kernel result (checking it is not declined) and the reference result."""
    args = (q, k, v, positions, scale)
    cuda = get_ops("cuda")
    assert get_ops("cuda").verifiers["attention_at_positions"](*args) is None
    result = cuda.attention_at_positions(*args)
    expected = get_ops("torch").attention_at_positions(*args)
    assert result.shape == expected.shape and result.dtype == q.dtype
    assert result.device.type == DEVICE
    return result, expected


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_k", [1, 63, 300])
def test_matches_reference(num_k, dtype, heads):
    q, k, v, positions = make_inputs(num_k, heads, 64, dtype, seed=num_k)
    result, expected = attend_both(q, k, v, positions, 64**-0.5)
    assert_close(result, expected, dtype)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_large_head_dims(head_dim):
    q, k, v, positions = make_inputs(150, (6, 2), head_dim, torch.bfloat16, seed=head_dim)
    result, expected = attend_both(q, k, v, positions, head_dim**-0.5)
    assert_close(result, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "num_k, window",
    [(300, 64), (300, 1), (200, 1000), (520, 256)],
    ids=["window-64", "window-1", "window-longer-than-prompt", "gemma3-head-dim"],
)
def test_sliding_window_matches_reference(num_k, window, dtype):
    """Gemma 3's local layers: each query sees its last ``window`` keys; a tile whose first
    query's window starts past key 0 skips the tiles before it."""
    head_dim = 256 if num_k == 520 else 64
    q, k, v, positions = make_inputs(num_k, (6, 2), head_dim, dtype, seed=window)
    args = (q, k, v, positions, head_dim**-0.5)
    cuda = get_ops("cuda")
    assert cuda.verifiers["attention_at_positions"](*args, window=window) is None
    result = cuda.attention_at_positions(*args, window=window)
    expected = get_ops("torch").attention_at_positions(*args, window=window)
    assert_close(result, expected, dtype)
    if window < num_k - 1:  # the window changes the answer: the test sees one not applied
        assert not torch.allclose(result.float(), attend_both(*args)[1].float(), atol=1e-2)


def test_a_bad_window_is_declined():
    q, k, v, positions = make_inputs(40, (4, 4), 64, torch.float32, seed=3)
    verify = get_ops("cuda").verifiers["attention_at_positions"]
    assert "at least one" in verify(q, k, v, positions, 0.1, window=0)
    assert "whole number" in verify(q, k, v, positions, 0.1, window=2.5)


def test_every_query_is_plain_causal_attention():
    """All tokens selected: the mask is the ordinary causal triangle."""
    q, k, v, positions = make_inputs(63, (6, 2), 64, torch.float32, seed=1, num_q=63)
    assert positions.tolist() == list(range(63))
    result, expected = attend_both(q, k, v, positions, 0.125)
    assert_close(result, expected, torch.float32)
    causal = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    assert_close(result, causal, torch.float32)


def test_mask_is_per_position_not_bottom_right():
    """Early queries must not see later keys (the bottom-right ``causal=True`` mistake)."""
    q, k, v, _ = make_inputs(200, (4, 4), 64, torch.float32, seed=2)
    positions = torch.tensor([0, 5, 17, 120], device=DEVICE)
    q = q[:4]
    result, expected = attend_both(q, k, v, positions, 0.125)
    assert_close(result, expected, torch.float32)
    # Position 0 sees only key 0: softmax over one key returns that key's value.
    assert_close(result[0], v[0], torch.float32)


def test_unsorted_positions_and_int32():
    q, k, v, positions = make_inputs(300, (6, 2), 64, torch.float16, seed=3)
    order = torch.randperm(positions.shape[0], generator=torch.Generator().manual_seed(3)).to(
        DEVICE
    )
    result, expected = attend_both(q[order], k, v, positions[order].to(torch.int32), 0.125)
    assert_close(result, expected, torch.float16)


def test_strided_views_of_fused_buffers():
    """q sliced from a fused QKV buffer, k and v from one interleaved ``[Nk, 2, Hkv, D]`` tensor."""
    gen = torch.Generator().manual_seed(4)
    num_k, hq, hkv, d = 300, 6, 2, 64
    q_all, _, _, positions = make_inputs(num_k, (hq, hkv), d, torch.bfloat16, seed=4)
    qkv = torch.randn(positions.shape[0], (hq + 2 * hkv) * d, generator=gen).to(
        DEVICE, torch.bfloat16
    )
    qkv[:, : hq * d] = q_all.reshape(-1, hq * d)
    q = qkv[:, : hq * d].view(-1, hq, d)
    kv = torch.randn(num_k, 2, hkv, d, generator=gen).to(DEVICE, torch.bfloat16)
    k, v = kv[:, 0], kv[:, 1]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    result, expected = attend_both(q, k, v, positions, d**-0.5)
    assert_close(result, expected, torch.bfloat16)


def test_writes_every_row_of_a_nan_output():
    q, k, v, positions = make_inputs(63, (8, 1), 64, torch.float32, seed=5)
    out = nan_like(torch.empty(q.shape, device=DEVICE))
    assert attention_at_positions(q, k, v, positions, 0.125, out=out) is out
    expected = get_ops("torch").attention_at_positions(q, k, v, positions, 0.125)
    assert_close(out, expected, torch.float32)


def test_no_queries():
    _, k, v, _ = make_inputs(63, (6, 2), 64, torch.float16, seed=6)
    q = torch.empty(0, 6, 64, dtype=torch.float16, device=DEVICE)
    result, expected = attend_both(q, k, v, torch.empty(0, dtype=torch.int64, device=DEVICE), 0.125)
    assert result.shape == (0, 6, 64)


#: every tiling choice the kernels take, at tiles small enough for the interpreter; each must
#: give the reference's answer (the tiles the GPU runs are timed in benchmarks/kernel_sweep.py)
TILINGS = {
    "plain": AttentionTiling(32, 16, 4, 2),
    "split": AttentionTiling(32, 16, 4, 2, split=True),
    "heavy-first": AttentionTiling(32, 16, 4, 2, heavy_first=True),
    "tma": AttentionTiling(32, 16, 4, 2, tma=True),
    "all": AttentionTiling(32, 16, 4, 2, split=True, heavy_first=True, tma=True),
}


@pytest.mark.parametrize("name", list(TILINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_every_tiling_matches_reference(name, dtype):
    """Positions far apart within a tile (a wide diagonal) and close together (whole key tiles
    seen by every row), group of 4, a tail tile with padding rows."""
    q, k, v, positions = make_inputs(150, (8, 2), 32, dtype, seed=7, num_q=45)
    expected = get_ops("torch").attention_at_positions(q, k, v, positions, 32**-0.5)
    result = attention_at_positions(q, k, v, positions, 32**-0.5, tiling=TILINGS[name])
    assert_close(result, expected, dtype)


def test_heavy_first_falls_back_when_the_grid_would_overflow():
    """More query tiles than a grid's second dimension holds: the tiles go first, in order."""
    tiling, grid = fit_grid(AttentionTiling(16, 16, 4, 2, heavy_first=True), 16 * 70000, 8)
    assert not tiling.heavy_first and grid == (70000, 8)
    tiling, grid = fit_grid(AttentionTiling(16, 16, 4, 2, heavy_first=True), 16 * 100, 8)
    assert tiling.heavy_first and grid == (8, 100)
