"""Triton row gather / scatter against the torch reference (on the GPU, or the interpreter).

A copy changes no value, so results must equal the reference exactly.
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, nan_like

from lmcache_backend.backends.cuda.rows import gather_rows
from lmcache_backend.ops import get_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SELECTIONS = ["empty", "one", "subset", "all-shuffled"]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pick(selection: str, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct int64 row indices in ``[0, num_tokens)`` of the named kind."""
    perm = torch.randperm(num_tokens, generator=gen).to(DEVICE)
    count = {"empty": 0, "one": 1, "subset": max(1, num_tokens * 15 // 100)}.get(
        selection, num_tokens
    )
    return perm[:count]


def check_served(op: str, *args) -> None:
    get_ops("cuda")  # loads the backend, which registers its kernels
    assert get_ops("cuda").verifiers[op](*args) is None, f"{op} was declined"


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens", [1, 63, 4097])
def test_gather_matches_reference(num_tokens, dtype, selection):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 2, 64, generator=gen).to(DEVICE, dtype)
    idx = pick(selection, num_tokens, gen)
    check_served("gather_rows", x, idx)
    result = get_ops("cuda").gather_rows(x, idx)
    expected = get_ops("torch").gather_rows(x, idx)
    assert result.shape == expected.shape and result.dtype == dtype
    assert result.device.type == DEVICE
    assert torch.equal(result, expected)


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens", [1, 63, 4097])
def test_scatter_matches_reference_in_place(num_tokens, dtype, selection):
    gen = torch.Generator().manual_seed(num_tokens + 1)
    dst = torch.randn(num_tokens, 2, 64, generator=gen).to(DEVICE, dtype)
    idx = pick(selection, num_tokens, gen)
    src = torch.randn(idx.shape[0], 2, 64, generator=gen).to(DEVICE, dtype)
    check_served("scatter_rows", dst, idx, src)
    expected = get_ops("torch").scatter_rows(dst.clone(), idx, src)
    assert get_ops("cuda").scatter_rows(dst, idx, src) is dst
    assert torch.equal(dst, expected)


def test_gather_writes_every_row_of_a_nan_output():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(63, 3, 64, generator=gen).to(DEVICE)
    idx = pick("subset", 63, gen)
    out = nan_like(torch.empty(idx.shape[0], 3, 64, device=DEVICE))
    assert gather_rows(x, idx, out=out) is out
    assert torch.equal(out, get_ops("torch").gather_rows(x, idx))


def test_scatter_into_nan_rows():
    """Rows scattered into a NaN buffer: exactly the indexed rows become finite."""
    gen = torch.Generator().manual_seed(3)
    dst = torch.full((63, 2, 64), float("nan"), device=DEVICE)
    idx = pick("subset", 63, gen)
    src = torch.randn(idx.shape[0], 2, 64, generator=gen).to(DEVICE)
    get_ops("cuda").scatter_rows(dst, idx, src)
    written = torch.zeros(63, dtype=torch.bool, device=DEVICE)
    written[idx] = True
    assert torch.equal(dst[idx], src)
    assert torch.isnan(dst[~written]).all()


def test_scatter_casts_to_the_destination_dtype():
    gen = torch.Generator().manual_seed(4)
    dst = torch.randn(63, 2, 64, generator=gen).to(DEVICE, torch.bfloat16)
    idx = pick("subset", 63, gen)
    src = torch.randn(idx.shape[0], 2, 64, generator=gen).to(DEVICE)  # fp32 source
    check_served("scatter_rows", dst, idx, src)
    expected = get_ops("torch").scatter_rows(dst.clone(), idx, src)
    get_ops("cuda").scatter_rows(dst, idx, src)
    assert torch.equal(dst, expected)


def test_int32_indices_and_strided_rows():
    """Rows of a wider buffer (row stride > row size) are read and written in place."""
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(63, 4 * 64, generator=gen, dtype=torch.float16).to(DEVICE)
    before = buf.clone()
    view = buf[:, 64:192].view(63, 2, 64)
    assert not view.is_contiguous()
    idx = pick("subset", 63, gen).to(torch.int32)
    check_served("gather_rows", view, idx)
    assert torch.equal(get_ops("cuda").gather_rows(view, idx), view[idx.long()])

    src = torch.randn(idx.shape[0], 2, 64, generator=gen, dtype=torch.float16).to(DEVICE)
    check_served("scatter_rows", view, idx, src)
    expected = before.clone()
    expected[:, 64:192].view(63, 2, 64)[idx.long()] = src
    get_ops("cuda").scatter_rows(view, idx, src)
    assert torch.equal(buf, expected)


def test_non_contiguous_source_rows_for_scatter():
    gen = torch.Generator().manual_seed(6)
    dst = torch.randn(63, 2, 64, generator=gen).to(DEVICE)
    idx = pick("subset", 63, gen)
    src = torch.randn(idx.shape[0], 64, 2, generator=gen).to(DEVICE).transpose(1, 2)
    check_served("scatter_rows", dst, idx, src)
    expected = get_ops("torch").scatter_rows(dst.clone(), idx, src)
    get_ops("cuda").scatter_rows(dst, idx, src)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.int32, torch.int64, torch.float64], ids=dtype_id
)
def test_rows_of_other_dtypes(dtype):
    """Masks, token ids and fp64 rows are copied bit for bit too."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(63, 3, 8, generator=gen) * 50).to(DEVICE, dtype)
    idx = pick("subset", 63, gen)
    check_served("gather_rows", x, idx)
    assert torch.equal(get_ops("cuda").gather_rows(x, idx), x[idx])
    src = (torch.randn(idx.shape[0], 3, 8, generator=gen) * 50).to(DEVICE, dtype)
    check_served("scatter_rows", x, idx, src)
    expected = get_ops("torch").scatter_rows(x.clone(), idx, src)
    get_ops("cuda").scatter_rows(x, idx, src)
    assert torch.equal(x, expected)
