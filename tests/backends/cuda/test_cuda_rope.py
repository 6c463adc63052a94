"""Triton RoPE re-rotation against the torch reference.

On the GPU when one is visible; without one the kernels run in Triton's interpreter on CPU
tensors (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, assert_close

from lmcache_backend.ops import get_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STYLES = [pytest.param(True, id="neox"), pytest.param(False, id="gptj")]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """vLLM's ``[max_pos, R]`` table: cosines then sines, fp32."""
    inv_freq = 1.0 / base ** (
        torch.arange(0, rot_dim, 2, dtype=torch.float64, device=DEVICE) / rot_dim
    )
    angles = torch.arange(max_pos, dtype=torch.float64, device=DEVICE)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def rerotate_both(k, old, new, table, is_neox):
    """Run the kernel (checking it is not declined) on ``k`` and the reference on a clone."""
    args = (k, old, new, table, is_neox)
    cuda = get_ops("cuda")  # loads the backend, which registers its kernels
    assert get_ops("cuda").verifiers["rope_rerotate_k"](*args) is None
    expected = get_ops("torch").rope_rerotate_k(k.clone(), old, new, table, is_neox)
    result = cuda.rope_rerotate_k(*args)
    assert result is k, "rope_rerotate_k must return its input, rotated in place"
    return expected


@pytest.fixture(scope="module")
def table_128() -> torch.Tensor:
    return cos_sin_cache(8192, 128)


@pytest.mark.parametrize("is_neox", STYLES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens", [1, 63, 4097])
def test_rerotate_matches_reference(num_tokens, dtype, is_neox, table_128):
    gen = torch.Generator().manual_seed(num_tokens)
    k = torch.randn(num_tokens, 2, 128, generator=gen).to(DEVICE, dtype)
    before = k.clone()
    old = torch.randint(0, 8192, (num_tokens,), generator=gen).to(DEVICE)
    new = torch.randint(0, 8192, (num_tokens,), generator=gen).to(DEVICE)
    expected = rerotate_both(k, old, new, table_128, is_neox)
    assert_close(k, expected, dtype)
    assert not torch.equal(k, before), "the keys were not rotated"


@pytest.mark.parametrize("layout", ["3d", "2d"])
@pytest.mark.parametrize("is_neox", STYLES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims_and_layouts(head_dim, is_neox, layout):
    gen = torch.Generator().manual_seed(head_dim)
    table = cos_sin_cache(4096, head_dim)
    k3 = torch.randn(63, 3, head_dim, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    k = k3 if layout == "3d" else k3.view(63, 3 * head_dim)
    old = torch.randint(0, 4096, (63,), generator=gen, dtype=torch.int32).to(DEVICE)
    new = torch.randint(0, 4096, (63,), generator=gen, dtype=torch.int32).to(DEVICE)
    expected = rerotate_both(k, old, new, table, is_neox)
    assert_close(k, expected, torch.bfloat16)


@pytest.mark.parametrize("is_neox", STYLES)
def test_partial_rotary_leaves_the_tail(is_neox):
    gen = torch.Generator().manual_seed(1)
    table = cos_sin_cache(4096, 32)  # rotary dim 32 of head dim 64
    k = torch.randn(63, 4, 64, generator=gen).to(DEVICE)
    tail = k[..., 32:].clone()
    old = torch.randint(0, 4096, (63,), generator=gen).to(DEVICE)
    new = torch.randint(0, 4096, (63,), generator=gen).to(DEVICE)
    expected = rerotate_both(k, old, new, table, is_neox)
    assert_close(k, expected, torch.float32)
    assert torch.equal(k[..., 32:], tail)


@pytest.mark.parametrize("is_neox", STYLES)
def test_slice_of_fused_qkv(is_neox, table_128):
    """K as a strided view into a fused ``[T, (Hq + 2 Hkv) * D]`` buffer: Q and V stay untouched."""
    gen = torch.Generator().manual_seed(2)
    num_tokens, hq, hkv, d = 63, 4, 2, 128
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen, dtype=torch.float16).to(DEVICE)
    before = qkv.clone()
    k = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
    assert not k.is_contiguous()
    old = torch.randint(0, 8192, (num_tokens,), generator=gen).to(DEVICE)
    new = torch.randint(0, 8192, (num_tokens,), generator=gen).to(DEVICE)
    expected = rerotate_both(k, old, new, table_128, is_neox)
    assert_close(k, expected, torch.float16)
    assert torch.equal(qkv[:, : hq * d], before[:, : hq * d])
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])


@pytest.mark.parametrize("is_neox", STYLES)
def test_positions_up_to_one_million(is_neox):
    # Rotary dim 16 of head dim 64 keeps the 2**20-row table at 64 MB.
    max_pos = 1 << 20
    table = cos_sin_cache(max_pos, 16)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(63, 2, 64, generator=gen).to(DEVICE)
    old = torch.randint(0, max_pos, (63,), generator=gen).to(DEVICE)
    new = torch.randint(max_pos - 4096, max_pos, (63,), generator=gen).to(DEVICE)
    old[0], new[0] = 0, max_pos - 1
    expected = rerotate_both(k, old, new, table, is_neox)
    assert_close(k, expected, torch.float32)


def test_same_positions_is_identity(table_128):
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(63, 2, 128, generator=gen).to(DEVICE)
    before = k.clone()
    pos = torch.randint(0, 8192, (63,), generator=gen).to(DEVICE)
    get_ops("cuda").rope_rerotate_k(k, pos, pos, table_128, True)
    assert_close(k, before, torch.float32)


def test_round_trip_restores_keys(table_128):
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(63, 2, 128, generator=gen).to(DEVICE)
    before = k.clone()
    old = torch.randint(0, 8192, (63,), generator=gen).to(DEVICE)
    new = torch.randint(0, 8192, (63,), generator=gen).to(DEVICE)
    ops = get_ops("cuda")
    ops.rope_rerotate_k(k, old, new, table_128, False)
    ops.rope_rerotate_k(k, new, old, table_128, False)
    torch.testing.assert_close(k, before, rtol=1e-5, atol=1e-5)


def test_empty_is_a_no_op(table_128):
    k = torch.empty(0, 2, 128, device=DEVICE)
    pos = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert get_ops("cuda").rope_rerotate_k(k, pos, pos, table_128, True) is k
