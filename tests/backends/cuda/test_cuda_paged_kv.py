"""Triton paged KV write/read against the torch reference (on the GPU, or the interpreter).

Caches start filled with NaN: after a write, exactly the mapped slots hold values and every other
slot is still NaN, so a stray or missing write shows.
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, assert_close, nan_like

from lmcache_backend.backends.cuda.paged_kv import paged_kv_read
from lmcache_backend.ops import get_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZE = 16


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_served(op: str, *args) -> None:
    get_ops("cuda")  # loads the backend, which registers its kernels
    assert get_ops("cuda").verifiers[op](*args) is None, f"{op} was declined"


def random_slots(num_tokens: int, num_blocks: int, gen: torch.Generator, padding: int = 0):
    """Distinct slots spread over the blocks, with ``padding`` entries set to -1."""
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen).to(DEVICE)[:num_tokens]
    if padding:
        slots[torch.randperm(num_tokens, generator=gen).to(DEVICE)[:padding]] = -1
    return slots


def nan_caches(num_blocks: int, heads: int, head_dim: int, dtype: torch.dtype):
    shape = (num_blocks, BLOCK_SIZE, heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return key_cache, key_cache.clone()


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values where written, NaN at the same places elsewhere."""
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), "written slots differ"
    assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens", [1, 63, 4097])
def test_write_matches_reference(num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    heads, head_dim = 2, 64
    num_blocks = num_tokens // BLOCK_SIZE + 3
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = random_slots(num_tokens, num_blocks, gen, padding=num_tokens // 10)
    key_cache, value_cache = nan_caches(num_blocks, heads, head_dim, dtype)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    check_served("paged_kv_write", key, value, key_cache, value_cache, slots)
    get_ops("cuda").paged_kv_write(key, value, key_cache, value_cache, slots)
    get_ops("torch").paged_kv_write(key, value, ref_k, ref_v, slots)
    assert_same_cache(key_cache, ref_k)
    assert_same_cache(value_cache, ref_v)
    written = int(torch.isnan(key_cache).logical_not().any(-1).any(-1).sum())
    assert written == int((slots >= 0).sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens", [1, 63, 4097])
def test_read_matches_reference(num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens + 1)
    num_blocks = num_tokens // BLOCK_SIZE + 3
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, 2, 64, generator=gen).to(DEVICE, dtype)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, 2, 64, generator=gen).to(DEVICE, dtype)
    slots = random_slots(num_tokens, num_blocks, gen)
    check_served("paged_kv_read", key_cache, value_cache, slots)
    key, value = get_ops("cuda").paged_kv_read(key_cache, value_cache, slots)
    ref_key, ref_value = get_ops("torch").paged_kv_read(key_cache, value_cache, slots)
    assert key.dtype == dtype and key.shape == (num_tokens, 2, 64)
    assert key.device.type == DEVICE
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)


def test_read_fills_every_row_of_nan_outputs():
    gen = torch.Generator().manual_seed(2)
    key_cache = torch.randn(8, BLOCK_SIZE, 4, 32, generator=gen).to(DEVICE)
    value_cache = torch.randn(8, BLOCK_SIZE, 4, 32, generator=gen).to(DEVICE)
    slots = random_slots(63, 8, gen)
    out = (
        nan_like(torch.empty(63, 4, 32, device=DEVICE)),
        nan_like(torch.empty(63, 4, 32, device=DEVICE)),
    )
    key, value = paged_kv_read(key_cache, value_cache, slots, out=out)
    assert key is out[0] and value is out[1]
    ref_key, ref_value = get_ops("torch").paged_kv_read(key_cache, value_cache, slots)
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)


def test_round_trip_through_interleaved_cache_view():
    """Caches as views ``kv[:, 0]``/``kv[:, 1]`` of one ``[num_blocks, 2, block, H, D]`` buffer,
    keys as a strided slice of a fused QKV buffer, int32 slots."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, head_dim, num_blocks = 63, 2, 64, 6
    kv = torch.full((num_blocks, 2, BLOCK_SIZE, heads, head_dim), float("nan"), device=DEVICE)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    assert not key_cache.is_contiguous()
    qkv = torch.randn(num_tokens, 4 * heads * head_dim, generator=gen).to(DEVICE)
    key = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    value = qkv[:, 2 * heads * head_dim : 3 * heads * head_dim].view(num_tokens, heads, head_dim)
    slots = random_slots(num_tokens, num_blocks, gen).to(torch.int32)
    # The reference needs caches it can flatten without a copy: give it contiguous ones.
    ref_k, ref_v = nan_caches(num_blocks, heads, head_dim, torch.float32)
    check_served("paged_kv_write", key, value, key_cache, value_cache, slots)
    get_ops("cuda").paged_kv_write(key, value, key_cache, value_cache, slots)
    get_ops("torch").paged_kv_write(key, value, ref_k, ref_v, slots)
    assert_same_cache(key_cache, ref_k)
    assert_same_cache(value_cache, ref_v)
    check_served("paged_kv_read", key_cache, value_cache, slots)
    back_k, back_v = get_ops("cuda").paged_kv_read(key_cache, value_cache, slots)
    assert torch.equal(back_k, key) and torch.equal(back_v, value)


def test_write_casts_to_the_cache_dtype():
    gen = torch.Generator().manual_seed(4)
    key = torch.randn(63, 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(63, 2, 64, generator=gen).to(DEVICE)
    slots = random_slots(63, 6, gen)
    key_cache, value_cache = nan_caches(6, 2, 64, torch.bfloat16)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    check_served("paged_kv_write", key, value, key_cache, value_cache, slots)
    get_ops("cuda").paged_kv_write(key, value, key_cache, value_cache, slots)
    get_ops("torch").paged_kv_write(key, value, ref_k, ref_v, slots)
    # The interpreter rounds fp32 -> bf16 toward zero where torch rounds to nearest: tolerance.
    flat = slots.long()
    assert_close(key_cache.view(-1, 2, 64)[flat], ref_k.view(-1, 2, 64)[flat], torch.bfloat16)
    assert_close(value_cache.view(-1, 2, 64)[flat], ref_v.view(-1, 2, 64)[flat], torch.bfloat16)
    assert torch.equal(torch.isnan(key_cache), torch.isnan(ref_k))


def test_all_padding_writes_nothing():
    key = torch.randn(63, 2, 64).to(DEVICE)
    key_cache, value_cache = nan_caches(6, 2, 64, torch.float32)
    slots = torch.full((63,), -1, dtype=torch.int64, device=DEVICE)
    # served by the kernel: a CPU key beside a GPU cache would go to the reference unnoticed
    check_served("paged_kv_write", key, key, key_cache, value_cache, slots)
    get_ops("cuda").paged_kv_write(key, key, key_cache, value_cache, slots)
    assert torch.isnan(key_cache).all() and torch.isnan(value_cache).all()


def test_read_rejects_padding_slots_like_the_reference():
    key_cache, value_cache = nan_caches(6, 2, 64, torch.float32)
    slots = torch.tensor([3, -1, 5], device=DEVICE)
    for backend in ("cuda", "torch"):
        with pytest.raises(ValueError, match="negative"):
            get_ops(backend).paged_kv_read(key_cache, value_cache, slots)


def test_empty_mapping():
    key_cache, value_cache = nan_caches(6, 2, 64, torch.float16)
    empty = torch.empty(0, 2, 64, dtype=torch.float16, device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    get_ops("cuda").paged_kv_write(empty, empty, key_cache, value_cache, slots)
    assert torch.isnan(key_cache).all()
    key, value = get_ops("cuda").paged_kv_read(key_cache, value_cache, slots)
    assert key.shape == (0, 2, 64) and value.dtype == torch.float16
