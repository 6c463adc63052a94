"""The torch reference ops: RoPE re-rotation, deviation top-k, exact-mask attention, paged copy."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import assert_close, nan_like

from lmcache_backend.models.base import rope_cos_sin_cache
from lmcache_backend.ops import get_ops
from lmcache_backend.ops.reference import (
    apply_rope,
    attention_at_positions,
    kv_deviation_topk,
    paged_kv_read,
    paged_kv_write,
    rope_rerotate_k,
    selection_count,
)

MAX_POS = 1 << 20  # positions up to 1M


def _table(rot_dim: int, max_pos: int = MAX_POS, theta: float = 1e5) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    return rope_cos_sin_cache(inv_freq, max_pos)


@pytest.fixture(scope="module")
def table64() -> torch.Tensor:
    return _table(64)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["3d", "2d"])
def test_rerotation_equals_rotation_at_new_positions(table64, is_neox, dtype, layout) -> None:
    torch.manual_seed(0)
    t, h, d = 37, 3, 64
    raw = torch.randn(t, h, d)
    old = torch.randint(0, MAX_POS, (t,))
    new = torch.randint(0, MAX_POS, (t,))
    new[:3] = torch.tensor([0, 1, MAX_POS - 1])
    cached = apply_rope(raw, old, table64, is_neox).to(dtype)
    k = cached.reshape(t, h * d).clone() if layout == "2d" else cached.clone()
    out = rope_rerotate_k(k, old, new, table64, is_neox)
    assert out is k  # in place
    expected = apply_rope(raw, new, table64, is_neox)
    assert_close(k.view(t, h, d), expected, dtype)


def test_partial_rotary_leaves_tail_untouched() -> None:
    table = _table(32, max_pos=4096)
    raw = torch.randn(5, 2, 64)
    old, new = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([100, 7, 3, 4000, 0])
    k = apply_rope(raw, old, table, True).clone()
    rope_rerotate_k(k, old, new, table, True)
    torch.testing.assert_close(k, apply_rope(raw, new, table, True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k[..., 32:], raw[..., 32:])


def test_rerotation_is_not_a_no_op(table64) -> None:
    raw = torch.randn(4, 1, 64)
    old, new = torch.tensor([0, 5, 9, 1000]), torch.tensor([3, 6, 900, 2])
    k = apply_rope(raw, old, table64, True)
    moved = rope_rerotate_k(k.clone(), old, new, table64, True)
    assert (moved - k).abs().max() > 0.1


@pytest.mark.parametrize(
    "ratio, n_valid, reusable, expected",
    [
        (0.0, 10, None, 0),
        (0.15, 10, None, 1),
        (0.01, 10, None, 1),
        (0.5, 10, None, 5),
        (1.0, 10, None, 10),
        (0.15, 0, None, 0),
        (0.15, 4, 100, 4),
        (0.15, 50, 100, 15),
    ],
)
def test_selection_count(ratio, n_valid, reusable, expected) -> None:
    assert selection_count(ratio, n_valid, reusable) == expected


def test_deviation_topk_picks_largest_and_all_invalid() -> None:
    t = 12
    fresh = torch.zeros(t, 2, 4)
    cached = torch.zeros(t, 2, 4)
    deviation = torch.tensor([0, 5, 1, 9, 0, 7, 3, 8, 2, 6, 4, 0.5])
    cached[:, 0, 0] = deviation.sqrt()
    valid = torch.ones(t, dtype=torch.bool)
    valid[[3, 10]] = False  # 3 has a large deviation but is invalid: selected anyway
    idx = kv_deviation_topk(fresh, cached, valid, ratio=0.3)  # int(0.3 * 10) = 3 valid tokens
    assert idx.dtype == torch.int64
    assert idx.tolist() == [3, 5, 7, 9, 10]  # valid 7, 5, 9 (8, 7, 6) + invalid 3, 10
    assert kv_deviation_topk(fresh, cached, valid, ratio=0.0).tolist() == [3, 10]
    assert kv_deviation_topk(fresh, cached, valid, 1.0).tolist() == list(range(t))
    # the ratio applies to num_reusable when given
    assert kv_deviation_topk(fresh, cached, valid, 0.1, num_reusable=40).tolist() == [
        1,
        3,
        5,
        7,
        9,
        10,
    ]


def _attention_brute_force(q, k, v, positions, scale, window=None):
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i, p in enumerate(positions.tolist()):
        first = 0 if window is None else max(p - window + 1, 0)
        for h in range(q.shape[1]):
            keys = k[first : p + 1, h // group].double()
            scores = keys @ q[i, h].double() * scale
            out[i, h] = torch.softmax(scores, 0) @ v[first : p + 1, h // group].double()
    return out


@pytest.mark.parametrize("window", [1, 5, 16, 64])
def test_attention_window_matches_brute_force(window) -> None:
    """A sliding window: the query at ``p`` attends keys ``p - window + 1 .. p``."""
    torch.manual_seed(4)
    nk, d = 50, 16
    k, v = torch.randn(nk, 2, d), torch.randn(nk, 2, d)
    positions = torch.tensor([0, 3, 17, 18, 49])
    q = torch.randn(positions.numel(), 4, d)
    out = attention_at_positions(q, k, v, positions, 0.25, window=window)
    expected = _attention_brute_force(q, k, v, positions, 0.25, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if window < nk:
        assert not torch.allclose(out, attention_at_positions(q, k, v, positions, 0.25))


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_attention_over_key_ranges_matches_brute_force(order, window) -> None:
    """Queries spread over a prompt many windows long: each block of queries attends over the
    keys its positions can see only (from the first one's window to the last one), sorted or
    not; a query near the start and the last position are both covered."""
    torch.manual_seed(7)
    nk, d = 400, 8
    k, v = torch.randn(nk, 1, d), torch.randn(nk, 1, d)
    positions = torch.cat(
        [torch.tensor([0, 1]), torch.randperm(nk - 3)[:60] + 2, torch.tensor([nk - 1])]
    )
    positions = positions.unique()  # sorted
    if order == "shuffled":
        positions = positions[torch.randperm(positions.numel())]
    q = torch.randn(positions.numel(), 2, d)
    out = attention_at_positions(q, k, v, positions, 0.3, window=window)
    expected = _attention_brute_force(q, k, v, positions, 0.3, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_which_kernels_take_a_sliding_window() -> None:
    """The CPU and Triton kernels apply a window themselves (their verifiers accept one, and
    decline a window that is not a whole number >= 1); the NPU kernel has none: its verifier
    declines such a call and the registry runs the reference."""
    from lmcache_backend.backends.ascend import attention as ascend
    from lmcache_backend.backends.cpu import tiled_attention as cpu

    q = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    k = torch.zeros(6, 2, 32, dtype=torch.bfloat16)
    positions = torch.tensor([3, 5])
    reason = ascend.verify_attention_at_positions(q, k, k, positions, 1.0, window=4)
    assert reason is not None and "sliding window" in reason
    windowed = [cpu.verify_attention_at_positions]
    try:
        from lmcache_backend.backends.cuda import attention as cuda

        windowed.append(cuda.verify_attention_at_positions)
    except ImportError:  # no Triton here
        pass
    for verify in windowed:
        assert verify(q, k, k, positions, 1.0, window=4) is None
        assert "window" in verify(q, k, k, positions, 1.0, window=0)
        assert "window" in verify(q, k, k, positions, 1.0, window=1.5)
    assert cpu.verify_attention_at_positions(q, k, k, positions, 1.0) is None


@pytest.mark.parametrize("hq, hkv", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa3", "gqa8"])
def test_attention_matches_brute_force(hq, hkv) -> None:
    torch.manual_seed(1)
    nk, d = 50, 16
    k, v = torch.randn(nk, hkv, d), torch.randn(nk, hkv, d)
    positions = torch.tensor([0, 3, 17, 18, 49])
    q = torch.randn(positions.numel(), hq, d)
    out = attention_at_positions(q, k, v, positions, 1 / math.sqrt(d))
    torch.testing.assert_close(
        out.double(),
        _attention_brute_force(q, k, v, positions, 1 / math.sqrt(d)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_attention_mask_is_exact() -> None:
    """Changing K/V after a query's position never changes that query's output."""
    torch.manual_seed(2)
    nk, d = 64, 8
    k, v = torch.randn(nk, 2, d), torch.randn(nk, 2, d)
    positions = torch.tensor([5, 20, 40, 63])
    q = torch.randn(4, 2, d)
    base = attention_at_positions(q, k, v, positions, 0.3)
    for i, p in enumerate(positions.tolist()):
        k2, v2 = k.clone(), v.clone()
        k2[p + 1 :] = torch.randn_like(k2[p + 1 :]) * 10
        v2[p + 1 :] = torch.randn_like(v2[p + 1 :]) * 10
        changed = attention_at_positions(q, k2, v2, positions, 0.3)
        torch.testing.assert_close(changed[i], base[i], rtol=0, atol=0)
        if p < nk - 1:
            # ...and K/V at or before p do matter (the test can fail)
            k3 = k.clone()
            k3[p] += 5
            assert not torch.equal(attention_at_positions(q, k3, v, positions, 0.3)[i], base[i])


def test_bottom_right_causal_is_not_the_exact_mask() -> None:
    """flash-attention's causal=True with fewer queries than keys aligns bottom-right."""
    torch.manual_seed(3)
    nk, d = 32, 8
    k, v = torch.randn(nk, 1, d), torch.randn(nk, 1, d)
    positions = torch.tensor([2, 10])
    q = torch.randn(2, 1, d)
    exact = attention_at_positions(q, k, v, positions, 0.5)
    # bottom-right triangle: query i of Nq sees keys 0 .. Nk - Nq + i
    mask = torch.arange(nk)[None, :] <= (nk - 2 + torch.arange(2))[:, None]
    bottom_right = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=0.5,
    )[0].transpose(0, 1)
    assert (exact - bottom_right).abs().max() > 1e-2


def test_attention_long_query_blocks() -> None:
    torch.manual_seed(4)
    nk = 2100  # more queries than one block of 1024
    k, v = torch.randn(nk, 1, 8), torch.randn(nk, 1, 8)
    q = torch.randn(nk, 2, 8)
    positions = torch.arange(nk)
    out = attention_at_positions(q, k, v, positions, 0.35)
    causal = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None].expand(1, 2, nk, 8),
        v.transpose(0, 1)[None].expand(1, 2, nk, 8),
        is_causal=True,
        scale=0.35,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, causal, rtol=1e-5, atol=1e-5)


def test_attention_empty_queries() -> None:
    out = attention_at_positions(
        torch.empty(0, 2, 8),
        torch.randn(5, 1, 8),
        torch.randn(5, 1, 8),
        torch.empty(0, dtype=torch.int64),
        0.3,
    )
    assert out.shape == (0, 2, 8)


def test_paged_write_read_roundtrip() -> None:
    torch.manual_seed(5)
    blocks, block_size, h, d = 6, 4, 2, 8
    key_cache = nan_like(torch.empty(blocks, block_size, h, d))
    value_cache = nan_like(torch.empty(blocks, block_size, h, d))
    key, value = torch.randn(7, h, d), torch.randn(7, h, d)
    slots = torch.tensor([5, 6, 7, 8, -1, 21, 0])
    paged_kv_write(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[1, 1], key[0]) and torch.equal(value_cache[5, 1], value[5])
    assert torch.isnan(key_cache).sum() == (blocks * block_size - 6) * h * d  # -1 skipped
    keep = slots >= 0
    k2, v2 = paged_kv_read(key_cache, value_cache, slots[keep])
    assert torch.equal(k2, key[keep]) and torch.equal(v2, value[keep])
    with pytest.raises(ValueError, match="negative"):
        paged_kv_read(key_cache, value_cache, slots)


def test_rows_gather_scatter() -> None:
    x = torch.arange(24.0).view(6, 4)
    idx = torch.tensor([4, 1])
    ops = get_ops("torch")
    assert torch.equal(ops.gather_rows(x, idx), x[[4, 1]])
    dst = nan_like(x)
    ops.scatter_rows(dst, idx, torch.ones(2, 4))
    assert torch.equal(dst[[1, 4]], torch.ones(2, 4)) and torch.isnan(dst[[0, 2, 3, 5]]).all()


def test_registry_names_and_errors(monkeypatch) -> None:
    ops = get_ops("torch")
    assert ops.name == "torch" and dict(ops.served_by)["attention_at_positions"] == "torch"
    with pytest.raises(ValueError, match="tpu"):
        get_ops("tpu")
    monkeypatch.setenv("LMCACHE_BACKEND", "torch")
    assert get_ops().name == "torch"
    assert get_ops("auto").name in ("torch", "cpu", "cuda", "ascend")


def test_paged_copy_on_strided_cache_view() -> None:
    """A cache laid out [num_blocks, 2, block_size, H, D] gives non-contiguous K/V views."""
    cache = torch.full((3, 2, 4, 1, 2), float("nan"))
    key, value = torch.randn(3, 1, 2), torch.randn(3, 1, 2)
    slots = torch.tensor([0, 5, 11])
    paged_kv_write(key, value, cache[:, 0], cache[:, 1], slots)
    k2, v2 = paged_kv_read(cache[:, 0], cache[:, 1], slots)
    assert torch.equal(k2, key) and torch.equal(v2, value)
    assert torch.equal(cache[1, 1, 1], value[1])


def test_deviation_topk_empty() -> None:
    empty = torch.empty(0, 2, 4)
    idx = kv_deviation_topk(empty, empty, torch.empty(0, dtype=torch.bool), 0.5)
    assert idx.numel() == 0 and idx.dtype == torch.int64
