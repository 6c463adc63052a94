"""The whole blender on each backend's ops: same result as with the torch reference ops.

CUDA: the Triton kernels, with the tiny model and its store on :data:`conftest.DEVICE` (the GPU
when one is visible, else CPU tensors through Triton's interpreter). Ascend: the backend's ops
with torch_npu replaced by the CPU emulation of its operators (``npu_emulation``), called
directly because the backend's verifiers send CPU tensors to the reference; that model and store
stay on the CPU, where the emulation runs.
"""

from __future__ import annotations

import npu_emulation
import pytest
import torch
from numerics import DEVICE
from tiny_hf import C1, C2, C3, Q1, Q2, SEP, SYS, rag_prompt, tiny_model

from lmcache_backend import ops as ops_registry
from lmcache_backend.blend import LMCBlender, SegmentCache
from lmcache_backend.config import load_config
from lmcache_backend.integration.hf.engine import hf_full_prefill
from lmcache_backend.models.hf import HFModelAdapter
from lmcache_backend.ops import OP_NAMES, Ops, get_ops
from lmcache_backend.storage import MemoryTier


def _warmed_on(device: str) -> tuple[HFModelAdapter, MemoryTier]:
    """The tiny model on ``device`` and a store there, warmed with one prompt's segments."""
    model = tiny_model("qwen3").to(device)
    adapter = HFModelAdapter(model)
    assert adapter.device.type == device
    store = MemoryTier(device, 1 << 30, "cpu" if device == "cpu" else "device")
    cache = SegmentCache(store, adapter.fingerprint, SEP)
    first = rag_prompt(SYS, C1, C2, C3, Q1)
    pre = hf_full_prefill(model, first)
    cache.store_segments(first, pre.keys, pre.values)
    return adapter, store


@pytest.fixture(scope="module")
def warmed() -> tuple[HFModelAdapter, MemoryTier]:
    return _warmed_on(DEVICE)


@pytest.fixture(scope="module")
def warmed_cpu(warmed) -> tuple[HFModelAdapter, MemoryTier]:
    # the same fixture where the tests run on the CPU anyway: the model is built once there
    return warmed if DEVICE == "cpu" else _warmed_on("cpu")


def _blend(adapter, store, ops: Ops):
    config = load_config(
        env={}, blend_min_tokens=0, blend_recompute_ratios=[0.3, 0.15], blend_check_layers=[1, 2]
    )
    return LMCBlender(store, None, config, adapter, SEP, ops).blend(rag_prompt(SYS, C3, C1, C2, Q2))


def _same(result, expected) -> None:
    assert torch.equal(result.recomputed, expected.recomputed)
    torch.testing.assert_close(result.logits, expected.logits, rtol=1e-4, atol=1e-4)
    for k, ek in zip(result.keys, expected.keys):
        torch.testing.assert_close(k, ek, rtol=1e-4, atol=1e-4)


def test_cuda_kernels_blend_like_the_reference(warmed) -> None:
    adapter, store = warmed
    ops = get_ops("cuda")  # compiled on the GPU, else Triton's interpreter (tests/conftest.py)
    assert all(by == "cuda" for _, by in ops.served_by)
    ops_registry._declined_logged.clear()
    result = _blend(adapter, store, ops)
    declined = [entry for entry in ops_registry._declined_logged if entry[0] == "cuda"]
    assert declined == []  # every call really ran a kernel
    assert result.logits.device.type == DEVICE and result.keys[0].device.type == DEVICE
    _same(result, _blend(adapter, store, get_ops("torch")))


def test_ascend_ops_blend_like_the_reference(warmed_cpu) -> None:
    from lmcache_backend.backends import ascend  # noqa: F401 - importing it registers its ops
    from lmcache_backend.backends.ascend import _npu
    from lmcache_backend.ops import implementations

    adapter, store = warmed_cpu
    registered = implementations("ascend")
    ops = Ops(name="ascend-emulated", **{name: registered[name] for name in OP_NAMES})
    npu_emulation.CALLS.clear()
    with _npu.use_npu_module(npu_emulation):
        result = _blend(adapter, store, ops)
    assert npu_emulation.CALLS["npu_rotary_mul"] > 0
    _same(result, _blend(adapter, store, get_ops("torch")))
