"""Refusals of :func:`layout_for`, the backend name it reads, and the worker's use of it.

Which forms are accepted, and that they write where their backend reads, is
``test_vllm_layouts_contract.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache_backend.integration.vllm.layouts import (
    UnsupportedKVCache,
    backend_name_of,
    layout_for,
    slots_for,
)
from lmcache_backend.ops import get_ops

H, D, NB, BS = 8, 128, 6, 16
BF16 = torch.bfloat16


def _choose(cache, backend: str | None = None, heads: int = H, block_size: int = BS):
    return layout_for(
        cache,
        num_kv_heads=heads,
        head_dim=D,
        block_size=block_size,
        backend_name=backend,
        ops=get_ops("torch"),
    )


def _pair(shape, dtype=BF16):
    return (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


REFUSED = {
    "3-D tensor": (lambda: torch.zeros(NB, BS, H * D, dtype=BF16), None, "3-D"),
    "tuple of three (DSA)": (
        lambda: (*_pair((NB, BS, H, D)), torch.zeros(NB, BS, 1, 128, dtype=BF16)),
        "CUSTOM",
        "3 caches per layer",
    ),
    "int8 K/V pair": (lambda: _pair((NB, BS, H, D), torch.int8), "ASCEND", "torch.int8"),
    "310P FRACTAL_NZ pair": (lambda: _pair((NB, H * D // 16, BS, 16)), "ASCEND", "FRACTAL_NZ"),
    "fp8 tensor": (
        lambda: torch.zeros(NB, H, BS, 2 * D, dtype=torch.float8_e4m3fn),
        "FLASH_ATTN",
        "quantized",
    ),
    "MLA nope/rope pair": (
        lambda: (torch.zeros(NB, BS, 1, 512, dtype=BF16), torch.zeros(NB, BS, 1, 64, dtype=BF16)),
        "ASCEND",
        "differ",
    ),
    "non-contiguous pair": (
        lambda: tuple(
            t.transpose(1, 2).contiguous().transpose(1, 2) for t in _pair((NB, BS, H, D))
        ),
        "ASCEND",
        "contiguous",
    ),
    "CPU backend": (lambda: torch.zeros(NB, H, BS, 2 * D, dtype=BF16), "CPU_ATTN", "CpuLayout"),
    "unknown backend": (
        lambda: torch.zeros(NB, H, BS, 2 * D, dtype=BF16),
        "FLEX_ATTENTION",
        "no recorded",
    ),
    "FlashInfer never kv-first": (
        lambda: torch.zeros(2, NB, BS, H, D, dtype=BF16),
        "FLASHINFER",
        "never handed over",
    ),
    "Ascend never a tensor": (
        lambda: torch.zeros(2, NB, BS, H, D, dtype=BF16),
        "ASCEND",
        "never handed over",
    ),
    "two blocks": (lambda: torch.zeros(2, 2, BS, H, D, dtype=BF16), None, "told apart"),
    "no K/V axis": (lambda: torch.zeros(NB, 3, BS, H, D, dtype=BF16), None, "size 2"),
    "head dim not innermost": (
        lambda: torch.zeros(NB, H, 2 * D, BS, dtype=BF16).transpose(2, 3),
        "FLASH_ATTN",
        "memory order",
    ),
    "a head-sliced 4-D cache": (
        lambda: torch.zeros(NB, BS, H, D, dtype=BF16),
        "FLASH_ATTN",
        "must be [NB, 8, BS, 256]",
    ),
    "not a tensor": (lambda: {"k": 1}, None, "neither a tensor"),
}


@pytest.mark.parametrize("case", REFUSED, ids=REFUSED.keys())
def test_unknown_forms_are_refused_in_one_line(case: str) -> None:
    make, backend, reason = REFUSED[case]
    with pytest.raises(ValueError) as info:
        _choose(make(), backend)
    message = str(info.value)
    assert isinstance(info.value, UnsupportedKVCache)
    assert "\n" not in message and reason in message
    assert (
        f"backend {backend or 'not named'}" in message and "supported: [2, NB, BS, H, D]" in message
    )
    if case != "not a tensor":
        assert "shape (" in message and "strides (" in message and "dtype torch." in message


def test_other_heads_than_the_model_are_refused() -> None:
    with pytest.raises(UnsupportedKVCache, match=r"\[NB, 4, BS, 256\]"):
        _choose(torch.zeros(NB, H, BS, 2 * D, dtype=BF16), "FLASH_ATTN", heads=4)


def test_cache_blocks_that_do_not_divide_scheduler_blocks_are_refused() -> None:
    with pytest.raises(UnsupportedKVCache, match="blocks of 16 tokens do not divide .* 24"):
        _choose(torch.zeros(NB, H, BS, 2 * D, dtype=BF16), "FLASH_ATTN", block_size=24)


def test_the_old_backend_names_are_known() -> None:
    layout = _choose(torch.zeros(2, NB, BS, H, D, dtype=BF16), "FLASH_ATTN_VLLM_V1")
    assert layout.backend == "FLASH_ATTN" and layout.memory == "NHD"


def test_backend_name_of_reads_the_layers_backend() -> None:
    class Backend:
        @staticmethod
        def get_name() -> str:
            return "TRITON_ATTN"

    assert backend_name_of(SimpleNamespace(attn_backend=Backend)) == "TRITON_ATTN"
    assert backend_name_of(SimpleNamespace(get_attn_backend=lambda: Backend)) == "TRITON_ATTN"
    assert backend_name_of(SimpleNamespace()) is None
    assert backend_name_of(None) is None


def test_the_worker_takes_ascend_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``register_kv_caches`` with ``(k, v)`` tuples, a layout from the layer's backend name,
    and ``read_rows`` over the pairs (no engine: the worker's pieces are stubs)."""
    from lmcache_backend.integration.vllm.worker_side import worker as worker_module
    from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide

    class Ascend:
        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=32),
        compilation_config=SimpleNamespace(
            static_forward_context={n: SimpleNamespace(attn_backend=Ascend) for n in names}
        ),
    )
    monkeypatch.setattr(worker_module, "detect_platform", lambda: "npu")  # read at construction
    worker = WorkerSide(
        SimpleNamespace(
            selected_attention="vllm", config=SimpleNamespace(backend="torch"), tp_size=1
        ),
        config,
        SimpleNamespace(kv_transfer_after_model_load=False),
    )
    caches = {n: _pair((NB, BS, H, D)) for n in reversed(names)}
    worker.register_kv_caches(caches)
    assert worker.caches == [caches[n] for n in names]
    model = SimpleNamespace(num_kv_heads=H, head_dim=D)
    worker.layout = worker._make_layout(model, get_ops("torch"))
    assert (worker.layout.backend, worker.layout.kernel_block_size) == ("CUSTOM", BS)
    slots = slots_for([2, 0], 32, 0, 40)
    keys = torch.randn(40, H, D).to(BF16)
    for i, name in enumerate(names):
        worker.layout.write(caches[name], keys + i, keys - i, slots)
    got_k, got_v = worker.read_rows(slots)
    assert all(torch.equal(k, keys + i) for i, k in enumerate(got_k))
    assert all(torch.equal(v, keys - i) for i, v in enumerate(got_v))
