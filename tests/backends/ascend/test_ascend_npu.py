"""The Ascend backend on a real NPU, through ``get_ops("ascend")``, against the torch reference.

The same checks as ``test_ascend_contract.py``, with real torch_npu operators instead of the
emulation. Skipped, with what is missing, where no NPU is usable. Run on a machine with an NPU:

    pip install '.[ascend]' pytest
    pytest tests/backends/ascend/test_ascend_npu.py -v
"""

from __future__ import annotations

import pytest
import torch
from test_ascend_common import (
    check_attention,
    check_deviation,
    check_gather,
    check_paged,
    check_rope,
    check_scatter,
    import_ascend_backend,
)

from lmcache_backend.device import npu_unavailable_reason

_REASON = npu_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no usable NPU: {_REASON}")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
TOKENS = [1, 63, 300, 4097]
NPU = "npu"


@pytest.fixture(scope="module")
def ops():
    from lmcache_backend.ops import get_ops

    import_ascend_backend()
    loaded = get_ops("ascend")
    served = dict(loaded.served_by)
    assert all(served[name] == "ascend" for name in served), served
    return loaded


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_rope_rerotate_k(ops, num_tokens, dtype, is_neox):
    check_rope(ops, NPU, num_tokens, dtype, is_neox)


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
    check_rope(ops, NPU, 63, torch.bfloat16, is_neox, **shape)


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_kv_deviation_topk(ops, num_tokens, dtype, ratio):
    check_deviation(ops, NPU, num_tokens, dtype, ratio)


@pytest.mark.parametrize("count", [0, 1, 17], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_gather_rows(ops, num_tokens, dtype, count):
    check_gather(ops, NPU, num_tokens, dtype, count)


@pytest.mark.parametrize("nan_prefill", [False, True], ids=["rand", "nan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_scatter_rows(ops, num_tokens, dtype, nan_prefill):
    check_scatter(ops, NPU, num_tokens, dtype, min(num_tokens, 17), nan_prefill=nan_prefill)
    check_scatter(ops, NPU, num_tokens, dtype, num_tokens, nan_prefill=True)


@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (16, 2)], ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "sizes",
    [(1, 1), (63, 1), (63, 10), (300, 45), (300, 300), (4097, 600)],
    ids=lambda s: f"Nk{s[0]}-Nq{s[1]}",
)
def test_attention_at_positions(ops, sizes, dtype, heads):
    check_attention(ops, NPU, sizes[0], sizes[1], dtype, heads=heads[0], kv_heads=heads[1])


@pytest.mark.parametrize("head_dim", [40, 128], ids=lambda d: f"D{d}")
def test_attention_head_dims(ops, head_dim):
    check_attention(ops, NPU, 300, 45, torch.bfloat16, heads=6, kv_heads=2, head_dim=head_dim)


@pytest.mark.parametrize("padding", [0, 5], ids=["dense", "padded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_paged_kv_write_read(ops, num_tokens, dtype, padding):
    check_paged(ops, NPU, num_tokens, dtype, padding=padding)


@pytest.mark.parametrize(
    "layout",
    [dict(block_size=128, kv_heads=1), dict(kv_heads=8, head_dim=128)],
    ids=["block128-H1", "block16-H8-D128"],
)
def test_paged_kv_layouts(ops, layout):
    check_paged(ops, NPU, 300, torch.float16, **layout)


def test_cpu_tensors_are_declined_to_the_reference(ops):
    """Tensors not on the NPU go to the torch reference instead of failing in torch_npu."""
    check_attention(ops, "cpu", 63, 10, torch.float16, heads=2, kv_heads=2)
    check_scatter(ops, "cpu", 63, torch.float16, 17, nan_prefill=True)
