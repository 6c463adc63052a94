"""Contract tests: the Ascend backend on CPU, its torch_npu operators replaced by the EMULATION
in ``npu_emulation.py``, compared with the torch reference ops.

What passing shows: the backend calls the torch_npu operators with the arguments, layouts and
mask convention their documentation describes, and given operators that behave as documented it
computes what the reference computes. What it cannot show: that the operators on a real NPU
behave as documented -- ``test_ascend_npu.py`` checks that where a device exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import npu_emulation
import pytest
import torch
from numerics import assert_close
from test_ascend_common import (
    check_attention,
    check_deviation,
    check_gather,
    check_paged,
    check_rope,
    check_scatter,
    import_ascend_backend,
    query_positions,
)

from lmcache_backend.ops import implementations, reference

backend = import_ascend_backend()
from lmcache_backend.backends.ascend import (  # noqa: E402
    _npu,
    attention,
    paged_kv,
    rope,
    rows,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
TOKENS = [1, 63, 300]
CPU = torch.device("cpu")


@pytest.fixture
def ops() -> Iterator[SimpleNamespace]:
    """The backend's ops, with torch_npu replaced by the emulation and its call counts reset."""
    npu_emulation.CALLS.clear()
    with _npu.use_npu_module(npu_emulation):
        yield SimpleNamespace(**implementations("ascend"))


# ----------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_rope_rerotate_k(ops, num_tokens, dtype, is_neox):
    check_rope(ops, CPU, num_tokens, dtype, is_neox)
    assert npu_emulation.CALLS["npu_rotary_mul"] == 1


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(heads=1, head_dim=128),
        dict(heads=8, head_dim=64, two_d=True),
        dict(heads=3, head_dim=64, rot_dim=32),
        dict(heads=2, head_dim=80),
    ],
    ids=["H1-D128", "H8-D64-2d", "H3-D64-partial32", "H2-D80"],
)
def test_rope_rerotate_k_shapes(ops, shape, is_neox):
    check_rope(ops, CPU, 63, torch.bfloat16, is_neox, **shape)


def test_rope_rerotate_k_empty_calls_nothing(ops):
    k = torch.empty(0, 2, 64)
    cache = torch.zeros(16, 64)
    none = torch.zeros(0, dtype=torch.int64)
    assert ops.rope_rerotate_k(k, none, none, cache, True) is k
    assert npu_emulation.CALLS["npu_rotary_mul"] == 0


def test_rope_pairing_matters(ops):
    """NeoX and GPT-J pairings give different results, so each test above pins its mode."""
    k = torch.randn(5, 2, 64)
    old, new = torch.arange(5), torch.arange(5) + 7
    from test_ascend_common import vllm_cos_sin_cache

    cache = vllm_cos_sin_cache(64, 64)
    a = ops.rope_rerotate_k(k.clone(), old, new, cache, True)
    b = ops.rope_rerotate_k(k.clone(), old, new, cache, False)
    assert (a - b).abs().max() > 1e-2


# ------------------------------------------------------------------------------ deviation


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_kv_deviation_topk(ops, num_tokens, dtype, ratio):
    check_deviation(ops, CPU, num_tokens, dtype, ratio)


@pytest.mark.parametrize(
    "case",
    [
        dict(invalid_fraction=0.0, ratio=0.0),  # nothing to recompute: empty selection
        dict(invalid_fraction=1.0, ratio=0.5),  # nothing cached: every token
        dict(invalid_fraction=0.2, ratio=0.15, num_reusable=40),  # ratio of the whole prompt
        dict(invalid_fraction=0.2, ratio=0.001),  # rounds to zero: at least one
    ],
    ids=["empty", "all-invalid", "num-reusable", "at-least-one"],
)
def test_kv_deviation_topk_edges(ops, case):
    ratio = case.pop("ratio")
    got = check_deviation(ops, CPU, 63, torch.float16, ratio, **case)
    if case["invalid_fraction"] == 0.0:
        assert got.numel() == 0


# ----------------------------------------------------------------------------------- rows


@pytest.mark.parametrize("count", [0, 1, 17], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_gather_rows(ops, num_tokens, dtype, count):
    check_gather(ops, CPU, num_tokens, dtype, count)


@pytest.mark.parametrize("nan_prefill", [False, True], ids=["rand", "nan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_scatter_rows(ops, num_tokens, dtype, nan_prefill):
    check_scatter(ops, CPU, num_tokens, dtype, min(num_tokens, 17), nan_prefill=nan_prefill)
    assert npu_emulation.CALLS["npu_scatter_nd_update_"] == 1


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_scatter_rows_every_row_of_nan(ops, num_tokens):
    check_scatter(ops, CPU, num_tokens, torch.bfloat16, num_tokens, nan_prefill=True)


def test_scatter_rows_empty_selection_calls_nothing(ops):
    check_scatter(ops, CPU, 63, torch.float16, 0, nan_prefill=True)
    assert npu_emulation.CALLS["npu_scatter_nd_update_"] == 0


# ------------------------------------------------------------------------------ attention

GQA = [(2, 2), (6, 2), (16, 2)]  # (query heads, key heads): ratios 1, 3, 8


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "sizes", [(1, 1), (63, 1), (63, 10), (300, 45), (300, 300)], ids=lambda s: f"Nk{s[0]}-Nq{s[1]}"
)
def test_attention_at_positions(ops, sizes, dtype, heads):
    num_keys, num_queries = sizes
    check_attention(ops, CPU, num_keys, num_queries, dtype, heads=heads[0], kv_heads=heads[1])
    fused = npu_emulation.CALLS["npu_fused_infer_attention_score"]
    # fp16/bf16 take the fused operator; fp32 is outside its dtypes and runs composed.
    assert fused == (0 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [40, 24], ids=lambda d: f"D{d}")
def test_attention_unaligned_head_dim_runs_composed(ops, dtype, head_dim):
    check_attention(ops, CPU, 63, 10, dtype, heads=6, kv_heads=2, head_dim=head_dim)
    assert npu_emulation.CALLS["npu_fused_infer_attention_score"] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_query_blocks(ops, monkeypatch, dtype):
    """Queries split over several calls (block of 16) give the same answer."""
    monkeypatch.setattr(attention, "_QUERY_BLOCK", 16)
    check_attention(ops, CPU, 300, 45, dtype, heads=6, kv_heads=2)
    if dtype != torch.float32:
        assert npu_emulation.CALLS["npu_fused_infer_attention_score"] == 3


def test_attention_no_queries(ops):
    q = torch.empty(0, 4, 64, dtype=torch.float16)
    k = torch.randn(10, 2, 64, dtype=torch.float16)
    out = ops.attention_at_positions(q, k, k, torch.zeros(0, dtype=torch.int64), 0.125)
    assert out.shape == (0, 4, 64)
    assert npu_emulation.CALLS["npu_fused_infer_attention_score"] == 0


def test_attention_mask_is_exact_not_bottom_right(ops):
    """A query early in the prompt must not see later keys (flash ``causal=True`` would)."""
    q = torch.randn(1, 2, 64, dtype=torch.float16)
    k = torch.randn(50, 2, 64, dtype=torch.float16)
    v = torch.zeros(50, 2, 64, dtype=torch.float16)
    v[5:] = 100.0  # any weight on a key after position 4 shows up
    out = ops.attention_at_positions(q, k, v, torch.tensor([4]), 0.125)
    assert out.float().abs().max() == 0


# ------------------------------------------------------------------------------- paged KV


@pytest.mark.parametrize("padding", [0, 5], ids=["dense", "padded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_paged_kv_write_read(ops, num_tokens, dtype, padding):
    check_paged(ops, CPU, num_tokens, dtype, padding=padding)
    calls = npu_emulation.CALLS
    if dtype == torch.float32:
        assert calls["npu_scatter_nd_update_"] == 2 and calls["_npu_reshape_and_cache"] == 0
    else:
        assert calls["_npu_reshape_and_cache"] == 1 and calls["npu_scatter_nd_update_"] == 0


@pytest.mark.parametrize(
    "layout",
    [dict(block_size=128, kv_heads=1), dict(kv_heads=8)],
    ids=["block128-H1", "block16-H8"],
)
def test_paged_kv_layouts(ops, layout):
    check_paged(ops, CPU, 300, torch.float16, **layout)


def test_paged_kv_write_only_padding_calls_nothing(ops):
    cache = torch.zeros(2, 16, 2, 32, dtype=torch.float16)
    key = torch.ones(3, 2, 32, dtype=torch.float16)
    ops.paged_kv_write(key, key, cache, cache.clone(), torch.full((3,), -1))
    assert not cache.any()
    assert npu_emulation.CALLS["_npu_reshape_and_cache"] == 0


def test_paged_kv_refuses_nz_caches_and_padding_reads(ops):
    nz = torch.zeros(2, 4, 16, 16, 1, dtype=torch.float16)  # 5-D: not the ND layout
    with pytest.raises(ValueError, match="ND"):
        ops.paged_kv_read(nz, nz, torch.tensor([0]))
    cache = torch.zeros(2, 16, 2, 32)
    with pytest.raises(ValueError, match="negative"):
        ops.paged_kv_read(cache, cache, torch.tensor([0, -1]))


# ------------------------------------------------- the emulation follows the documentation


def test_emulated_mask_true_means_masked_out():
    """Doc: atten_mask 1/True = not computed. Only key 0 left unmasked -> output is v[0]."""
    q = torch.randn(1, 1, 1, 16, dtype=torch.float16)  # BSND
    k = torch.randn(1, 8, 1, 16, dtype=torch.float16)
    v = torch.randn(1, 8, 1, 16, dtype=torch.float16)
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    mask[..., 0] = False
    out, _ = npu_emulation.npu_fused_infer_attention_score(
        q, k, v, atten_mask=mask, num_heads=1, input_layout="BSND", scale=1.0
    )
    assert torch.equal(out[0, 0, 0], v[0, 0, 0])


def test_a_flipped_mask_convention_is_caught(ops, monkeypatch):
    """Read the mask the torch way (True = keep) and the contract test must fail."""
    monkeypatch.setattr(npu_emulation, "MASK_TRUE_MEANS_MASKED", False)
    with pytest.raises(AssertionError):
        check_attention(ops, CPU, 63, 10, torch.float16, heads=2, kv_heads=2)


def test_emulated_rotary_mul_modes_follow_the_formulas():
    x = torch.arange(8, dtype=torch.float32).reshape(1, 1, 1, 8)
    zeros, ones = torch.zeros_like(x), torch.ones_like(x)
    half = npu_emulation.npu_rotary_mul(x, zeros, ones, rotary_mode="half")
    inter = npu_emulation.npu_rotary_mul(x, zeros, ones, rotary_mode="interleave")
    assert half.flatten().tolist() == [-4, -5, -6, -7, 0, 1, 2, 3]
    assert inter.flatten().tolist() == [-1, 0, -3, 2, -5, 4, -7, 6]


def test_emulation_rejects_undocumented_calls():
    x = torch.randn(1, 5, 2, 8)
    with pytest.raises(npu_emulation.EmulatedOpError, match="4-D"):
        npu_emulation.npu_rotary_mul(x[0], x[0], x[0])
    with pytest.raises(npu_emulation.EmulatedOpError, match="not allowed"):
        npu_emulation.npu_rotary_mul(
            x, torch.ones(1, 5, 2, 8) * 0.5, torch.zeros(1, 5, 2, 8), rotary_mode="interleave"
        )  # interleave needs 1S1D
    with pytest.raises(npu_emulation.EmulatedOpError, match="range"):
        npu_emulation.npu_rotary_mul(x, torch.full((1, 5, 1, 8), 1.5), torch.zeros(1, 5, 1, 8))
    q = torch.randn(1, 4, 2, 64)
    with pytest.raises(npu_emulation.EmulatedOpError, match="dtype"):
        npu_emulation.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BSND")
    with pytest.raises(npu_emulation.EmulatedOpError, match="slot_indices dtype"):
        c = torch.zeros(2, 16, 2, 32, dtype=torch.float16)
        r = torch.zeros(1, 2, 32, dtype=torch.float16)
        npu_emulation._npu_reshape_and_cache(r, r, c, c, torch.tensor([0]))
    with pytest.raises(npu_emulation.EmulatedOpError, match="out of range"):
        npu_emulation.npu_scatter_nd_update_(
            torch.zeros(4, 2), torch.tensor([[4]]), torch.zeros(1, 2)
        )


def test_emulated_gqa_grouping_is_consecutive():
    """Query heads 0..g-1 read key head 0 (the grouping vLLM and torch SDPA use)."""
    q = torch.randn(1, 3, 4, 16, dtype=torch.float16)  # BSND, 4 query heads
    k = torch.randn(1, 3, 2, 16, dtype=torch.float16)
    v = torch.randn(1, 3, 2, 16, dtype=torch.float16)
    out, _ = npu_emulation.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=0.25
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k.float().transpose(1, 2),
        v.float().transpose(1, 2),
        scale=0.25,
        enable_gqa=True,
    ).transpose(1, 2)
    assert_close(out, expected, torch.float16)


# ------------------------------------------------------------------------------ verifiers


def _verifier(op: str):
    """The Ascend backend's verifier of ``op``, as registered."""
    from lmcache_backend.ops import _REGISTERED

    return _REGISTERED["ascend"][op][1]


def test_verifiers_decline_cpu_tensors():
    k = torch.randn(4, 2, 64)
    cache = torch.zeros(16, 64)
    pos = torch.arange(4)
    assert "not npu" in _verifier("rope_rerotate_k")(k, pos, pos, cache, True)
    assert "not npu" in _verifier("attention_at_positions")(k, k, k, pos, 1.0)
    assert "not npu" in _verifier("scatter_rows")(k, pos, k)


def test_dtype_and_shape_reasons():
    pos = torch.arange(4)
    k64 = torch.randn(4, 2, 64, dtype=torch.float64)
    assert "dtype" in rope.rope_unsupported_reason(k64, pos, pos, torch.zeros(8, 64), True)
    k = torch.randn(4, 2, 64)
    assert rope.rope_unsupported_reason(k, pos, pos, torch.zeros(8, 64), True) is None
    assert "rotary dim" in rope.rope_unsupported_reason(
        torch.randn(4, 1, 900), pos, pos, torch.zeros(8, 900), True
    )
    i32 = torch.zeros(4, 3, dtype=torch.int32)
    assert "dtype" in rows.scatter_unsupported_reason(i32, pos, i32)
    assert rows.scatter_unsupported_reason(k, pos, k) is None
    c64 = torch.zeros(2, 16, 2, 8, dtype=torch.float64)
    assert "dtype" in paged_kv.paged_write_unsupported_reason(k, k, c64, c64, pos)
    h = torch.randn(3, 4, 64, dtype=torch.float16)
    assert attention.fused_unsupported_reason(h, h[:, :2], h[:, :2]) is None
    assert "dtype" in attention.fused_unsupported_reason(h.float(), h[:, :2], h[:, :2])
    assert "head dim" in attention.fused_unsupported_reason(
        h[..., :40], h[:, :2, :40], h[:, :2, :40]
    )


def test_positions_helper_keeps_the_last_token():
    pos = query_positions(63, 10, torch.Generator().manual_seed(1))
    assert pos[-1] == 62 and pos.numel() == 10 and torch.equal(pos, pos.unique())
    assert reference.selection_count(0.15, 40) == 6
