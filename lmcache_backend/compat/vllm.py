"""The code paths of the vLLM integration, one per range of vLLM releases, in one table.

Each range holds the recorded releases (``tests/fixtures/engine_contracts``, read from the released
wheels) in which every name, place and signature the integration touches is the same:

=============  =============================================================================
code path      what changes at its first release
=============  =============================================================================
0.9.2-0.10.0   (oldest) 2-argument connector constructor, connector created before the model
               is loaded, ``get_input_embeddings``, ``resumed_from_preemption``,
               ``rotary_embedding.py``, ``compute_logits(hidden_states, sampling_metadata)``
0.10.2         ``RotaryEmbedding`` moves to ``rotary_embedding/base.py``; the connector base
               gains ``update_connector_output`` (sliced loads)
0.11.0         ``compute_logits(hidden_states)``
0.11.2         ``kv_cache_config`` constructor argument, connector created after the model is
               loaded, ``embed_input_ids``, ``resumed_req_ids``, ``has_connector_metadata``
0.12.0-0.20.2  the V2 model runner exists (``VLLM_USE_V2_MODEL_RUNNER=1``)
0.21.0-0.22.1  the connector factory refuses a constructor without ``kv_cache_config``
0.23.0-0.25.1  per-layer KV caches ``[num_blocks, 2, ...]`` (flash-attention) and
               ``[num_blocks, H, block_size, 2*D]`` (CPU): the CPU code path starts here
0.26.0-0.28.0  flash-attention caches: ``[num_blocks, H, block_size, 2*D]`` views of
               ``[num_blocks, block_size, H, 2*D]``
0.29.0-0.33.0  ``KVCacheLayout`` (LBNHC / LBHNC views)
=============  =============================================================================

Which model runner vLLM builds by default changes inside these ranges and does not change the
code path (the plugin wraps both runners): the V2 runner is the default for a few listed dense
architectures in 0.22.1-0.24.0, for every dense (non-MoE) model from 0.25.1 and for every model
from 0.29.0 (:data:`V2_RUNNER_DEFAULT`).

A release between two recorded ones maps to the range holding both; one between two ranges
(0.10.1, 0.11.1) has no record, and the gate (:mod:`lmcache_backend.compat.gate`) picks the code
path its installed source satisfies. Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses

from lmcache_backend.compat.profile import (
    CPU,
    GPU_V1,
    GPU_V2,
    NPU_V1,
    KvCacheLayout,
    Runner,
    VllmProfile,
)
from lmcache_backend.compat.versions import release, vkey

_HEAD = ("num_kv_heads", "head_size")
_CPU_OP_PARAMS = ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa")
_CPU_OP_SCALES = ("k_scale", "v_scale", "kv_cache_dtype")


def _runners(v2: bool) -> dict[str, tuple[Runner, ...]]:
    """CUDA: the V1 runner, and the V2 runner where the release has one; NPU: vllm-ascend's V1
    runner, and vLLM's V2 runner, whose ``load_model`` vllm-ascend's V2 runner inherits."""
    extra = (GPU_V2,) if v2 else ()
    return {"cuda": (GPU_V1, *extra), "cpu": (CPU,), "npu": (NPU_V1, *extra)}


_FLASH_NHD = KvCacheLayout("FLASH_ATTN", "NHD", ("2", "num_blocks", "block_size", *_HEAD))
#: On SM100 (Blackwell) vLLM prefers FLASHINFER and has it read HND (0.10.0-0.28.0: the platform's
#: ``set_kv_cache_layout("HND")``, then ``get_required_kv_cache_layout``) or LBHNC (0.29+:
#: ``supported_kv_cache_layouts``): the ``"cuda-sm100"`` entries of ``kv_cache_layouts``.
_SM100 = "on SM100 / Blackwell, where vLLM prefers FlashInfer"
_FLASHINFER_HND = KvCacheLayout(
    "FLASHINFER",
    "HND",
    ("num_blocks", "2", "block_size", *_HEAD),
    ("num_blocks", "2", "num_kv_heads", "block_size", "head_size"),
    note=_SM100,
)

_OLDEST = VllmProfile(
    first="0.9.2",
    last="0.10.0",
    connector_init_params=("vllm_config", "role"),
    connector_requires_kv_cache_config=False,
    connector_base_calls=("_get_connector_metadata",),
    kv_transfer_after_model_load=False,
    embed_method="get_input_embeddings",
    resumed_field="resumed_from_preemption",
    rotary_path="vllm/model_executor/layers/rotary_embedding.py",
    compute_logits_params=("hidden_states", "sampling_metadata"),
    sliced_loads=False,
    model_runners=_runners(v2=False),
    cpu_cache_write_op=None,
    kv_cache_layouts={"cuda": _FLASH_NHD},
)


def _next(previous: VllmProfile, first: str, last: str, **changes) -> VllmProfile:
    """The profile after ``previous``: the same names but for ``changes``."""
    return dataclasses.replace(previous, first=first, last=last, release=first, **changes)


_P0102 = _next(
    _OLDEST,
    "0.10.2",
    "0.10.2",
    rotary_path="vllm/model_executor/layers/rotary_embedding/base.py",
    sliced_loads=True,
    kv_cache_layouts={"cuda": _FLASH_NHD, "cuda-sm100": _FLASHINFER_HND},
)
_P0110 = _next(_P0102, "0.11.0", "0.11.0", compute_logits_params=("hidden_states",))
_P0112 = _next(
    _P0110,
    "0.11.2",
    "0.11.2",
    connector_init_params=("vllm_config", "role", "kv_cache_config"),
    connector_base_calls=("_get_connector_metadata", "has_connector_metadata"),
    kv_transfer_after_model_load=True,
    embed_method="embed_input_ids",
    resumed_field="resumed_req_ids",
    kv_cache_layouts={
        "cuda": _FLASH_NHD,
        "cuda-sm100": _FLASHINFER_HND,
        "cpu": KvCacheLayout(
            "CPU_ATTN", "NHD", ("2", "num_blocks", "num_kv_heads", "block_size", "head_size")
        ),
    },
)
_P0120 = _next(_P0112, "0.12.0", "0.20.2", model_runners=_runners(v2=True))
_P0210 = _next(_P0120, "0.21.0", "0.22.1", connector_requires_kv_cache_config=True)
_CPU_PACKED = KvCacheLayout(
    "CPU_ATTN", "NHD", ("num_blocks", "num_kv_heads", "block_size", "2 * head_size")
)
_P0230 = _next(
    _P0210,
    "0.23.0",
    "0.25.1",
    cpu_cache_write_op="cpu_attn_reshape_and_cache",
    cpu_cache_write_params=_CPU_OP_PARAMS + _CPU_OP_SCALES,
    kv_cache_layouts={
        "cuda": KvCacheLayout("FLASH_ATTN", "NHD", ("num_blocks", "2", "block_size", *_HEAD)),
        "cuda-sm100": _FLASHINFER_HND,
        "cpu": _CPU_PACKED,
    },
)
_P0260 = _next(
    _P0230,
    "0.26.0",
    "0.28.0",
    kv_cache_layouts={
        "cuda": KvCacheLayout(
            "FLASH_ATTN",
            "NHD",
            ("num_blocks", "num_kv_heads", "block_size", "2 * head_size"),
            ("num_blocks", "block_size", "num_kv_heads", "2 * head_size"),
        ),
        "cuda-sm100": KvCacheLayout(
            "FLASHINFER",
            "HND",
            ("num_blocks", "num_kv_heads", "block_size", "2 * head_size"),
            note=_SM100,
        ),
        "cpu": _CPU_PACKED,
    },
)
_VIEW = ("num_blocks", "num_kv_heads", "block_size", "head_size + head_size_v")
_P0290 = _next(
    _P0260,
    "0.29.0",
    "0.33.0",
    kv_cache_layouts={
        "cuda": KvCacheLayout(
            "FLASH_ATTN",
            "LBNHC",
            _VIEW,
            ("num_blocks", "block_size", "num_kv_heads", "head_size + head_size_v"),
        ),
        "cuda-sm100": KvCacheLayout("FLASHINFER", "LBHNC", _VIEW, note=_SM100),
        "cpu": KvCacheLayout("CPU_ATTN", "LBHNC", _VIEW),
    },
)

#: The code paths, oldest first; their ranges do not overlap.
PROFILES: tuple[VllmProfile, ...] = (
    _OLDEST,
    _P0102,
    _P0110,
    _P0112,
    _P0120,
    _P0210,
    _P0230,
    _P0260,
    _P0290,
)

OLDEST_RELEASE = PROFILES[0].first
NEWEST_RELEASE = PROFILES[-1].last

#: The first release whose connector base has ``update_connector_output``, through which the
#: scheduler learns of a finished asynchronous load (the connector's sliced blends).
SLICED_FIRST_RELEASE = next(p.first for p in PROFILES if p.sliced_loads)

_PACKED = next(i for i, p in enumerate(PROFILES) if len(p.kv_cache_layouts["cuda"].shape) == 4)
#: The releases whose CUDA caches are 5-D (``[2, NB, BS, H, D]`` or ``[NB, 2, BS, H, D]``), first
#: and last, and the first whose caches are packed ``[NB, H, BS, 2*D]``.
FIVE_D_CUDA_CACHES = (PROFILES[0].first, PROFILES[_PACKED - 1].last)
PACKED_CUDA_CACHES_FROM = PROFILES[_PACKED].first

#: Recorded releases no code path serves, with the reason (checked against their record).
INCOMPATIBLE: dict[str, str] = {
    "0.9.1": "its scheduler hands connectors one CachedRequestData per request (batched, with "
    "req_ids, from 0.9.2)",
}

#: Which models vLLM builds on its V2 model runner by default (without
#: ``VLLM_USE_V2_MODEL_RUNNER``), by range of recorded releases ``(first, last, models)``, read
#: from ``vllm/config/vllm.py::VllmConfig.use_v2_model_runner`` and
#: ``_is_default_v2_model_runner_model``. Even then V1 runs where Triton is missing or the V2
#: runner lacks a feature the configuration uses.
V2_RUNNER_DEFAULT: tuple[tuple[str, str, str], ...] = (
    ("0.12.0", "0.21.0", "none (only with VLLM_USE_V2_MODEL_RUNNER=1)"),
    ("0.22.1", "0.22.1", "Qwen3ForCausalLM, unless MoE or quantized"),
    (
        "0.23.0",
        "0.23.0",
        "LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, unless MoE or quantized",
    ),
    (
        "0.24.0",
        "0.24.0",
        "the listed architectures only (DeepseekV2ForCausalLM, GraniteMoeForCausalLM, "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM)",
    ),
    (
        "0.25.1",
        "0.28.0",
        "every dense (non-MoE) generative model and a few listed MoE architectures, unless "
        "hybrid or attention-free",
    ),
    ("0.29.0", "0.33.0", "every model (on ROCm some architectures keep V1)"),
)


def v2_runner_default(version: str) -> str | None:
    """Which models ``version`` runs on the V2 runner by default; None outside the recorded
    ranges (before the V2 runner, between two ranges, after the newest)."""
    core = release(version)
    for first, last, models in V2_RUNNER_DEFAULT if core else ():
        if vkey(first) <= vkey(core) <= vkey(last):  # type: ignore[arg-type]
            return models
    return None


SOURCE_ONLY = "source contract only"

#: How a release that no real engine ran is verified, by platform: its source contract, and on
#: CUDA and Ascend the connector's whole worker path on CPU tensors shaped as the release hands
#: its KV cache over (Triton kernels under the interpreter, torch-npu ops emulated). A release
#: counts as run on CUDA only once docs/hardware.md records a vLLM engine run of it.
CHECKED_WITHOUT_ENGINE: dict[str, str] = {
    "cuda": "source contract + CPU-tensor path",
    "npu": "source contract + CPU-tensor path, torch-npu emulated",
}
#: What the matrix rows' CPU-tensor paths are shaped as (rows are not per platform).
CHECKED_SUMMARY = "CUDA- and Ascend-shaped caches"

#: Releases run on a real engine, by platform; everything else is checked without one.
VERIFIED_ON_ENGINE: dict[str, dict[str, str]] = {"0.32.0": {"cpu": "CPU build, real engine"}}
#: The release whose asynchronous KV loads (the connector's sliced blends,
#: ``blend_layers_per_step``) were checked on a real engine: ``auto`` slices on it only.
SLICED_VERIFIED_RELEASE = "0.32.0"


def verification(version: str, platform: str) -> str:
    """How ``version`` is verified on ``platform``: ``stable`` with the engine it ran on, or
    what was checked without one."""
    ran = VERIFIED_ON_ENGINE.get(release(version) or "", {}).get(platform)
    return f"stable: {ran}" if ran else CHECKED_WITHOUT_ENGINE.get(platform, SOURCE_ONLY)


def profile_for(version: str | None) -> VllmProfile | None:
    """The code path whose range holds ``version`` (its release core), bound to that release;
    None outside every range (older, newer, or between two ranges)."""
    core = release(version)
    if core is None:
        return None
    for profile in PROFILES:
        if vkey(profile.first) <= vkey(core) <= vkey(profile.last):
            return dataclasses.replace(profile, release=core)
    return None


def neighbours(version: str) -> tuple[VllmProfile | None, VllmProfile | None]:
    """The code paths just before and just after ``version`` (None past either end)."""
    key = vkey(version)
    before = [p for p in PROFILES if vkey(p.last) < key]
    after = [p for p in PROFILES if vkey(p.first) > key]
    return (before[-1] if before else None), (after[0] if after else None)


def cpu_releases() -> list[str]:
    """First release of every code path with a CPU backend."""
    return [p.first for p in PROFILES if p.has_cpu_path]
