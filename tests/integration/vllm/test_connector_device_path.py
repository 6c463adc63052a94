"""The connector's whole worker path on every recorded CUDA and Ascend cache form, on tensors
shaped exactly as the released engines hand them over: ``register_kv_caches``, the layout chosen
from the cache, a prompt's segments saved from the paged cache, a reordered prompt's lookup,
load, re-rotation, selection, the selected queries' attention through the block table and the
write-back, streamed one layer at a time. The blended rows, read back the way the engine's
attention backend reads them, equal the CPU path's (the layer-by-layer blend with the torch
reference ops) within the dtype's tolerance.

The CUDA forms run the Triton kernels with the caches, the model and the comparison on
:data:`conftest.DEVICE` (compiled on the GPU when one is visible, else CPU tensors under
``TRITON_INTERPRET=1``). The Ascend forms stay on CPU tensors, with their torch_npu operators
emulated there.

Each distinct form is run once, on the newest release that hands it over; the layout contract
tests (``test_vllm_layouts_contract.py``) cover every release of every form.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import replace
from types import SimpleNamespace

import npu_emulation
import pytest
import torch
from engine_cache_forms import (
    Geometry,
    Recorded,
    ascend_pair,
    backend_rows,
    build_cache,
    load,
    recorded_tensors,
)
from numerics import DEVICE, relative_error

from lmcache_backend import ops as ops_registry
from lmcache_backend.blend import LMCBlender
from lmcache_backend.config import load_config
from lmcache_backend.integration.hf.engine import hf_full_prefill
from lmcache_backend.integration.vllm.layouts import slots_for
from lmcache_backend.integration.vllm.metadata import LoadSpec, SaveSpec
from lmcache_backend.integration.vllm.settings import ConnectorSettings
from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide
from lmcache_backend.models.hf import HFModelAdapter
from lmcache_backend.ops import OP_NAMES, Ops, get_ops, implementations

pytest.importorskip("triton")

SEP = [5, 6]
BLOCK = 16
VOCAB = 256


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYS, C1, C2, C3, Q1, Q2 = (_ids(n, s) for s, n in enumerate((12, 40, 33, 51, 9, 7), start=1))


def _prompt(*parts: list[int]) -> list[int]:
    out: list[int] = []
    for part in parts[:-1]:
        out += part + SEP
    return out + parts[-1]


#: the model sizes: a tiny fp32 one, and bf16 with head dim 128 and grouped-query attention
MODELS = {
    "fp32-tiny": dict(dtype=torch.float32, heads=4, kv_heads=2, head_dim=16, hidden=64),
    "bf16-D128-gqa4": dict(dtype=torch.bfloat16, heads=8, kv_heads=2, head_dim=128, hidden=256),
}
#: the largest relative error of a layer's blended rows against the CPU path, per dtype
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _model(size: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    m = MODELS[size]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=m["hidden"],
        intermediate_size=2 * m["hidden"],
        num_hidden_layers=2,
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        head_dim=m["head_dim"],
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=m["dtype"]).eval()


@pytest.fixture(scope="module", params=list(MODELS))
def model(request) -> tuple[str, torch.nn.Module]:
    """A model size and its model on the CPU (the Ascend forms' emulation runs there)."""
    return request.param, _model(request.param)


@pytest.fixture(scope="module")
def device_model(model) -> tuple[str, torch.nn.Module]:
    """The same model on :data:`DEVICE`, for the CUDA forms (the very one on a CPU-only run)."""
    size, hf = model
    return size, hf if DEVICE == "cpu" else deepcopy(hf).to(DEVICE)


def _distinct_forms() -> list[Recorded]:
    """One recorded tensor per distinct (shape, memory order, read), the newest release's."""
    forms: dict[tuple, Recorded] = {}
    for r in recorded_tensors():
        key = (tuple(r.tensor["logical_shape"]), tuple(r.tensor["stride_order"]), r.kv_read)
        forms[key] = r
    return sorted(forms.values(), key=lambda r: r.id)


CUDA_FORMS = _distinct_forms()
ASCEND = load("vllm-ascend")


def _worker(
    caches: dict,
    backend_name: str,
    ops: Ops,
    monkeypatch,
    selected_attention: str = "auto",
    selection: str = "query_preview_last",
) -> WorkerSide:
    """A worker over ``caches`` as vLLM would build it on a device, with ``ops``; the selected
    queries attend per ``selected_attention`` (``auto`` on CUDA: over the layer's contiguous
    rows where the blend holds them, else through the block table; ``vllm``: through the block
    table), the tokens chosen by ``selection`` (the preview leaves the rows in the blocks only;
    ``kv_deviation`` holds each layer's rows)."""
    names = list(caches)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        compilation_config=SimpleNamespace(
            static_forward_context={
                n: SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend_name))
                for n in names
            }
        ),
        model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB),
    )
    config = load_config(
        env={},
        enable_blending=True,
        blend_min_tokens=0,
        blend_recompute_ratios=[0.3],
        blend_selection=selection,
        extra_config={"segment_index": False},
    )
    settings = ConnectorSettings(
        config=config,
        instance_id="device-path-test",
        tp_size=1,
        separator=SEP,
        stats_file=None,
        allow_untested_versions=False,
        selected_attention=selected_attention,
    )
    profile = SimpleNamespace(kv_transfer_after_model_load=False)
    worker = WorkerSide(settings, vllm_config, profile, platform="cuda")
    monkeypatch.setattr(worker, "_ops", lambda: ops)
    worker.register_kv_caches(caches)
    return worker


def _blend_through_worker(worker: WorkerSide, model: torch.nn.Module) -> tuple[list[int], int]:
    """Prefill ``SYS C1 C2 C3 Q1`` "as vLLM would" into blocks 1..n and save its segments, then
    load the reordered ``SYS C3 C1 C2 Q2`` into other blocks; its tokens and blocks."""
    warm = _prompt(SYS, C1, C2, C3, Q1)
    blocks_a = list(range(1, (len(warm) + BLOCK - 1) // BLOCK + 1))
    prefill = hf_full_prefill(model, warm)
    slots = slots_for(blocks_a, BLOCK, 0, len(warm))
    for layer, cache in enumerate(worker.caches):
        worker.layout.write(cache, prefill.keys[layer], prefill.values[layer], slots)
    assert worker.save(SaveSpec("warm", warm, blocks_a)) > 0
    asked = _prompt(SYS, C3, C1, C2, Q2)
    first = blocks_a[-1] + 1
    blocks_b = list(range(first + (len(asked) + BLOCK - 1) // BLOCK - 1, first - 1, -1))
    end = len(asked) - len(Q2)
    record = worker.load(LoadSpec("asked", asked, blocks_b, 0, end))
    assert record.fallback_reason is None and record.recomputed_reusable > 0
    # every layer's selected queries attended through the blocks, but the last layer's (its
    # attention output is read by nothing when vLLM computes the question)
    assert record.vllm_attention_layers == len(worker.caches) - 1
    return asked, blocks_b


def _cpu_path(model: torch.nn.Module, asked: list[int], worker: WorkerSide):
    """The same blend on the CPU path: the layer-by-layer blend with the torch reference ops,
    its K/V contiguous, over the same store."""
    blender = LMCBlender(
        worker.store, None, worker.settings.config, HFModelAdapter(model), SEP, get_ops("torch")
    )
    return blender.blend(asked, compute_end=len(asked) - len(Q2))


def _check(read_layer, model, asked, worker, dtype) -> None:
    reference = _cpu_path(model, asked, worker)
    end = len(asked) - len(Q2)
    for layer in range(len(worker.caches)):
        keys, values = read_layer(layer, end)
        assert not torch.isnan(keys).any() and not torch.isnan(values).any(), layer
        for got, want in ((keys, reference.keys[layer]), (values, reference.values[layer])):
            err = relative_error(got.float(), want[:end].float())
            assert err <= TOLERANCE[dtype], f"layer {layer}: relative error {err:.2e}"


#: Every form with the defaults (the preview selection: its attention reads the rows in the
#: blocks, through the block table); the newest and the oldest also with ``kv_deviation``, whose
#: layers hold their rows contiguous: attended there (``auto``) or through the blocks (``vllm``).
CASES = [(f, "query_preview_last", "auto") for f in CUDA_FORMS] + [
    (f, "kv_deviation", attention)
    for f in (CUDA_FORMS[0], CUDA_FORMS[-1])
    for attention in ("auto", "vllm")
]


@pytest.mark.parametrize(
    "form, selection, selected_attention",
    CASES,
    ids=lambda v: v.id if isinstance(v, Recorded) else v,
)
def test_cuda_forms_blend_like_the_cpu_path(
    form, selection, selected_attention, device_model, monkeypatch
) -> None:
    size, hf = device_model
    m = MODELS[size]
    geometry = Geometry(m["dtype"], m["kv_heads"], m["head_dim"], num_blocks=24, block_size=BLOCK)
    caches = {
        f"model.layers.{i}.self_attn.attn": build_cache(form.tensor, geometry, DEVICE)
        for i in (0, 1)
    }
    worker = _worker(caches, form.name, get_ops("cuda"), monkeypatch, selected_attention, selection)
    adapter = HFModelAdapter(hf)
    assert adapter.device.type == DEVICE
    worker.build(adapter)
    kernels = worker.loads.target.kernels
    assert kernels.device and kernels.device_contiguous == (selected_attention == "auto")
    ops_registry._declined_logged.clear()
    asked, blocks = _blend_through_worker(worker, hf)
    # every call the kernels got ran one: a tensor left on the CPU beside a GPU would be declined
    # and answered by the reference
    assert [entry for entry in ops_registry._declined_logged if entry[0] == "cuda"] == []

    def read_layer(layer: int, end: int):
        positions = list(range(end))
        return backend_rows(
            form,
            worker.caches[layer],
            m["head_dim"],
            [blocks[p // BLOCK] for p in positions],
            [p % BLOCK for p in positions],
        )

    _check(read_layer, hf, asked, worker, m["dtype"])


@pytest.mark.parametrize("data", ASCEND, ids=lambda d: d["version"])
def test_ascend_forms_blend_like_the_cpu_path(data, model, monkeypatch) -> None:
    from lmcache_backend.backends import ascend  # noqa: F401 - importing it registers its ops
    from lmcache_backend.backends.ascend import _npu

    size, hf = model
    m = MODELS[size]
    geometry = Geometry(m["dtype"], m["kv_heads"], m["head_dim"], num_blocks=24, block_size=BLOCK)
    caches = {f"model.layers.{i}.self_attn.attn": ascend_pair(data, geometry) for i in (0, 1)}
    registered = implementations("ascend")
    emulated = replace(
        get_ops("torch"), name="ascend-emulated", **{op: registered[op] for op in OP_NAMES}
    )
    npu_emulation.CALLS.clear()
    with _npu.use_npu_module(npu_emulation):
        worker = _worker(caches, "CUSTOM", emulated, monkeypatch)
        worker.build(HFModelAdapter(hf))
        asked, blocks = _blend_through_worker(worker, hf)
    # the emulated torch_npu operators ran (the fused attention takes fp16/bf16 only)
    assert npu_emulation.CALLS["npu_rotary_mul"] > 0
    if m["dtype"] == torch.bfloat16:
        assert npu_emulation.CALLS["npu_fused_infer_attention_score"] > 0

    def read_layer(layer: int, end: int):
        k_cache, v_cache = worker.caches[layer]
        rows = [(blocks[p // BLOCK], p % BLOCK) for p in range(end)]
        return torch.stack([k_cache[b, o] for b, o in rows]), torch.stack(
            [v_cache[b, o] for b, o in rows]
        )

    _check(read_layer, hf, asked, worker, m["dtype"])
