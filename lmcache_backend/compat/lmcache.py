"""What differs between the LMCache releases this package plugs into, as data.

LMCache's CacheBlend lives in a handful of modules whose shape changed between releases. The
families below name every module, class, method, attribute and argument the glue
(:mod:`lmcache_backend.integration.lmcache.glue`) reads, calls or replaces; the glue looks each
one up here by key, and the contract tests check every entry against the release's source.

==========  ===============================================================================
family      differences
==========  ===============================================================================
0.3.3       ``LMCBlender(cache_engine, gpu_connector, vllm_model)`` and
            ``LMCBlenderBuilder.get_or_create(instance_id, cache_engine, gpu_connector)``:
            no config reaches the blender (check layer 1 and ratio 0.15 are hard-coded;
            the engine config has a single ``blend_recompute_ratio``).
            ``infer_model_from_vllm(vllm_model, blender)``; the Llama model builds
            ``LMCFlashAttnBackend`` itself and sets ``LMCFlashAttnMetadata`` fields after a
            check layer. The legacy ``lmcache.blend`` executor/retriever API is shipped.
0.3.7       the config is passed: ``LMCBlender(..., vllm_model, config)``,
            ``get_or_create(..., gpu_connector, config)``; ``infer_model_from_vllm`` takes
            ``enable_sparse``; the Llama model picks its attention through
            ``infer_attn_backend_from_vllm`` and metadata has ``update_from_top_indices``.
            ``blend_check_layers`` / ``blend_recompute_ratios`` are engine config keys.
            The legacy ``lmcache.blend`` API is still shipped.
0.3.12      as 0.3.7, but the layerwise model loop moved to ``lmcache.v1.compute.models.base``
            (``LMCBaseModel``, shared by Llama, Qwen2 and Qwen3), so the positional-encoding
            and attention factories are looked up there; ``lmcache.blend`` is gone.
==========  ===============================================================================

Nothing here imports LMCache.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lmcache_backend.compat import release
from lmcache_backend.compat.versions import vkey


class Kind(str, Enum):
    """How a symbol appears in the release's source (what the contract test looks for)."""

    DEF = "def"  # a function or method; ``params`` are its parameters after self/cls
    CLASS = "class"
    NAME = "name"  # a module- or class-level binding (assignment, import, def or class)
    ATTR = "attr"  # an instance attribute set as ``self.<name> = ...`` in a method
    CONFIG_KEY = "config_key"  # a key of a dict literal in the module (LMCache config tables)
    CALL = "call"  # the module calls ``qualname(...)`` with ``nargs`` positional arguments


@dataclass(frozen=True)
class Symbol:
    """One LMCache name the glue relies on.

    Attributes:
        key: the glue's name for it (stable across families).
        module: dotted module, e.g. ``lmcache.v1.compute.blend.utils``.
        qualname: dotted path inside the module, e.g. ``LMCBlenderBuilder.get_or_create``.
        kind: see :class:`Kind`.
        params: for ``DEF``: the exact parameter names after ``self``/``cls`` (None: not checked).
        var_keyword: for ``DEF``: the function must take ``**kwargs``.
        nargs: for ``CALL``: number of positional arguments at the call site.
        replaced: the glue replaces this binding while installed (uninstall restores it).
    """

    key: str
    module: str
    qualname: str
    kind: Kind = Kind.DEF
    params: tuple[str, ...] | None = None
    var_keyword: bool = False
    nargs: int | None = None
    replaced: bool = False

    @property
    def attr(self) -> str:
        """The last component of ``qualname``."""
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def owner(self) -> str | None:
        """The class part of ``qualname`` (None for a module-level name)."""
        return self.qualname.rsplit(".", 1)[0] if "." in self.qualname else None

    def describe(self) -> str:
        sig = f"({', '.join(self.params)})" if self.params is not None else ""
        return f"{self.module}:{self.qualname}{sig} [{self.kind.value}]"


# -- modules ------------------------------------------------------------------------------------

BLEND_UTILS = "lmcache.v1.compute.blend.utils"
BLENDER = "lmcache.v1.compute.blend.blender"
MODEL_UTILS = "lmcache.v1.compute.models.utils"
LLAMA = "lmcache.v1.compute.models.llama"
MODEL_BASE = "lmcache.v1.compute.models.base"
ROPE = "lmcache.v1.compute.positional_encoding"
FLASH_ATTN = "lmcache.v1.compute.attention.flash_attn"
ATTN_UTILS = "lmcache.v1.compute.attention.utils"
ATTN_ABSTRACT = "lmcache.v1.compute.attention.abstract"
ATTN_METADATA = "lmcache.v1.compute.attention.metadata"
GPU_CONNECTOR = "lmcache.v1.gpu_connector"
CACHE_ENGINE = "lmcache.v1.cache_engine"
ENGINE_CONFIG = "lmcache.v1.config"
V1_ADAPTER = "lmcache.integration.vllm.vllm_v1_adapter"
LEGACY_EXECUTOR = "lmcache.blend.executor"
LEGACY_INTERFACES = "lmcache.blend.interfaces"

_BLEND_ARGS = (
    "layer_id",
    "retrieved_k",
    "retrieved_v",
    "valid_mask",
    "original_positions",
    "fresh_q",
    "fresh_k",
    "fresh_v",
    "positions",
    "query_start_loc",
    "token_dim",
)
_ROPE_ARGS = (
    "head_size",
    "rotary_dim",
    "max_position",
    "base",
    "is_neox_style",
    "rope_scaling",
    "dtype",
    "partial_rotary_factor",
)
_PROCESS_QKV_ARGS = ("q", "k", "v", "residual", "layer_id", "attn_output", "attn_metadata")
_FORWARD_ARGS = ("query", "key", "value", "output", "attn_metadata")

# Symbols every family relies on, in the same place with the same shape.
_COMMON: tuple[Symbol, ...] = (
    Symbol("builder", BLEND_UTILS, "LMCBlenderBuilder", Kind.CLASS),
    Symbol("builder_blenders", BLEND_UTILS, "LMCBlenderBuilder._blenders", Kind.NAME),
    Symbol("builder_get", BLEND_UTILS, "LMCBlenderBuilder.get", params=("instance_id",)),
    Symbol("tracker_get_model", MODEL_UTILS, "VLLMModelTracker.get_model", params=("instance_id",)),
    Symbol("blender_process_qkv", BLENDER, "LMCBlender.process_qkv", params=_PROCESS_QKV_ARGS),
    Symbol(
        "blender_blend_layer",
        BLENDER,
        "LMCBlender.blend_layer",
        params=("tokens", "mask"),
        var_keyword=True,
    ),
    Symbol(
        "blender_blend", BLENDER, "LMCBlender.blend", params=("tokens", "mask"), var_keyword=True
    ),
    Symbol("blender_layerwise_model", BLENDER, "LMCBlender.layerwise_model", Kind.ATTR),
    Symbol("blender_num_layers", BLENDER, "LMCBlender.num_layers", Kind.ATTR),
    Symbol("rope_factory", ROPE, "get_fused_rope", params=_ROPE_ARGS),
    Symbol("rope_call", ROPE, "FusedRope.__call__", params=("old_positions", "new_positions", "k")),
    Symbol(
        "gpu_get_kv", GPU_CONNECTOR, "VLLMBufferLayerwiseGPUConnector.get_kv", params=("layer_id",)
    ),
    Symbol(
        "gpu_gap_positions",
        GPU_CONNECTOR,
        "VLLMBufferLayerwiseGPUConnector.current_gap_positions",
        Kind.ATTR,
    ),
    Symbol(
        "engine_retrieve_layer",
        CACHE_ENGINE,
        "LMCacheEngine.retrieve_layer",
        params=("tokens", "mask"),
        var_keyword=True,
    ),
    Symbol("engine_config", CACHE_ENGINE, "LMCacheEngine.config", Kind.ATTR),
    Symbol(
        "attn_forward",
        FLASH_ATTN,
        "LMCFlashAttnBackend.forward_contiguous",
        params=_FORWARD_ARGS,
        var_keyword=True,
    ),
    Symbol("attn_backend_init", FLASH_ATTN, "LMCFlashAttnBackend.__init__", params=("vllm_attn",)),
)

_LEGACY: tuple[Symbol, ...] = (
    Symbol("legacy_executor", LEGACY_EXECUTOR, "CacheBlendImpl", Kind.NAME, replaced=True),
    Symbol(
        "legacy_executor_init",
        LEGACY_EXECUTOR,
        "CacheBlendImpl.__init__",
        params=("recompute_ratio", "all_reduce_function"),
    ),
    Symbol("legacy_executor_blend", LEGACY_EXECUTOR, "CacheBlendImpl.blend", params=_BLEND_ARGS),
    Symbol(
        "legacy_set_encoder",
        LEGACY_EXECUTOR,
        "CacheBlendImpl.set_positional_encoder",
        params=("positional_encoder",),
    ),
    Symbol(
        "legacy_set_reverse_encoder",
        LEGACY_EXECUTOR,
        "CacheBlendImpl.set_reverse_positional_encoder",
        params=("reverse_positional_encoder",),
    ),
    Symbol("legacy_output", LEGACY_INTERFACES, "BlendOutput", Kind.CLASS),
    Symbol("legacy_retriever_result", LEGACY_INTERFACES, "BlendRetrieverResult", Kind.CLASS),
)

# Fields of the legacy dataclasses, in order (this package's dataclasses carry the same ones).
LEGACY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlendOutput": ("q", "k", "v", "positions", "local_indices", "query_start_loc"),
    "BlendRetrieverResult": ("k", "v", "valid_mask", "original_positions"),
}


@dataclass(frozen=True)
class LMCacheFamily:
    """The LMCache releases sharing one set of symbols.

    Attributes:
        name: the family's first release, e.g. ``"0.3.7"``.
        verified: releases whose source was checked against ``symbols``.
        upto: first release *not* covered (None: open-ended); used only when forced.
        symbols: everything the glue touches in this family.
        config_keys: LMCache engine config keys the blender reads (the rest comes from this
            package's configuration).
    """

    name: str
    verified: tuple[str, ...]
    upto: str | None
    symbols: tuple[Symbol, ...]
    config_keys: tuple[str, ...]

    def symbol(self, key: str) -> Symbol:
        """The symbol the glue calls ``key`` (KeyError if this family has none)."""
        for sym in self.symbols:
            if sym.key == key:
                return sym
        raise KeyError(f"LMCache {self.name} glue has no symbol {key!r}")

    def has(self, key: str) -> bool:
        return any(sym.key == key for sym in self.symbols)

    @property
    def replaced(self) -> tuple[Symbol, ...]:
        """The bindings installing replaces, in order."""
        return tuple(sym for sym in self.symbols if sym.replaced)

    @property
    def has_legacy_blend(self) -> bool:
        return self.has("legacy_executor")


FAMILY_0_3_3 = LMCacheFamily(
    name="0.3.3",
    verified=("0.3.3",),
    upto="0.3.7",
    config_keys=("blend_recompute_ratio", "blend_min_tokens"),
    symbols=_COMMON
    + _LEGACY
    + (
        Symbol(
            "builder_get_or_create",
            BLEND_UTILS,
            "LMCBlenderBuilder.get_or_create",
            params=("instance_id", "cache_engine", "gpu_connector"),
            replaced=True,
        ),
        Symbol(
            "connector_creates_blender",
            V1_ADAPTER,
            "LMCBlenderBuilder.get_or_create",
            Kind.CALL,
            nargs=3,
        ),
        Symbol(
            "blender_init",
            BLENDER,
            "LMCBlender.__init__",
            params=("cache_engine", "gpu_connector", "vllm_model"),
        ),
        Symbol(
            "infer_model", MODEL_UTILS, "infer_model_from_vllm", params=("vllm_model", "blender")
        ),
        Symbol("rope_hook", LLAMA, "get_fused_rope", Kind.NAME, replaced=True),
        Symbol("attn_hook", LLAMA, "LMCFlashAttnBackend", Kind.NAME, replaced=True),
        Symbol("model_compute_layer", LLAMA, "LMCLlamaModel.compute_layer", params=("input_ids",)),
        Symbol("model_fused_rope", LLAMA, "LMCLlamaModel.fused_rotary_emb", Kind.ATTR),
        Symbol("model_vllm_model", LLAMA, "LMCLlamaModel.vllm_model", Kind.ATTR),
        Symbol(
            "attn_metadata_qsl", ATTN_METADATA, "LMCFlashAttnMetadata.query_start_loc", Kind.NAME
        ),
        Symbol("attn_metadata_mql", ATTN_METADATA, "LMCFlashAttnMetadata.max_query_len", Kind.NAME),
        Symbol(
            "config_ratio", ENGINE_CONFIG, "LMCacheEngineConfig.blend_recompute_ratio", Kind.NAME
        ),
        Symbol(
            "config_min_tokens", ENGINE_CONFIG, "LMCacheEngineConfig.blend_min_tokens", Kind.NAME
        ),
    ),
)

_FROM_0_3_7: tuple[Symbol, ...] = (
    Symbol(
        "builder_get_or_create",
        BLEND_UTILS,
        "LMCBlenderBuilder.get_or_create",
        params=("instance_id", "cache_engine", "gpu_connector", "config"),
        replaced=True,
    ),
    Symbol(
        "connector_creates_blender",
        V1_ADAPTER,
        "LMCBlenderBuilder.get_or_create",
        Kind.CALL,
        nargs=4,
    ),
    Symbol(
        "blender_init",
        BLENDER,
        "LMCBlender.__init__",
        params=("cache_engine", "gpu_connector", "vllm_model", "config"),
    ),
    Symbol(
        "infer_model",
        MODEL_UTILS,
        "infer_model_from_vllm",
        params=("vllm_model", "blender", "enable_sparse"),
    ),
    Symbol(
        "attn_factory",
        ATTN_UTILS,
        "infer_attn_backend_from_vllm",
        params=("vllm_attn", "enable_sparse"),
    ),
    Symbol(
        "attn_init_metadata",
        ATTN_ABSTRACT,
        "AttentionInterface.init_attn_metadata",
        params=("input_ids",),
        var_keyword=True,
    ),
    Symbol(
        "attn_metadata_update",
        ATTN_METADATA,
        "LMCAttnMetadata.update_from_top_indices",
        params=("top_indices",),
    ),
    Symbol("config_check_layers", ENGINE_CONFIG, "blend_check_layers", Kind.CONFIG_KEY),
    Symbol("config_ratios", ENGINE_CONFIG, "blend_recompute_ratios", Kind.CONFIG_KEY),
    Symbol("config_min_tokens", ENGINE_CONFIG, "blend_min_tokens", Kind.CONFIG_KEY),
    Symbol("config_extra", ENGINE_CONFIG, "extra_config", Kind.CONFIG_KEY),
)


def _model_loop(module: str, cls: str) -> tuple[Symbol, ...]:
    """Where the layerwise model loop and its factories live."""
    return (
        Symbol("rope_hook", module, "get_fused_rope", Kind.NAME, replaced=True),
        Symbol("attn_hook", module, "infer_attn_backend_from_vllm", Kind.NAME, replaced=True),
        Symbol("model_compute_layer", module, f"{cls}.compute_layer", params=("input_ids",)),
        Symbol("model_fused_rope", module, f"{cls}.fused_rotary_emb", Kind.ATTR),
        Symbol("model_vllm_model", module, f"{cls}.vllm_model", Kind.ATTR),
    )


FAMILY_0_3_7 = LMCacheFamily(
    name="0.3.7",
    verified=("0.3.7",),
    upto="0.3.12",
    config_keys=("blend_check_layers", "blend_recompute_ratios", "blend_min_tokens"),
    symbols=_COMMON + _LEGACY + _FROM_0_3_7 + _model_loop(LLAMA, "LMCLlamaModel"),
)

FAMILY_0_3_12 = LMCacheFamily(
    name="0.3.12",
    verified=("0.3.12",),
    upto=None,
    config_keys=("blend_check_layers", "blend_recompute_ratios", "blend_min_tokens"),
    symbols=_COMMON + _FROM_0_3_7 + _model_loop(MODEL_BASE, "LMCBaseModel"),
)

FAMILIES: tuple[LMCacheFamily, ...] = (FAMILY_0_3_3, FAMILY_0_3_7, FAMILY_0_3_12)


def family_for(lmcache_version: str, forced: bool = False) -> LMCacheFamily | None:
    """The family of ``lmcache_version``.

    A verified release always maps to its family. Any other release maps to the family whose
    range holds it only when ``forced`` (its symbols are still checked at install time);
    otherwise, or below the oldest family, None.
    """
    core = release(lmcache_version)
    for family in FAMILIES:
        if core in family.verified:
            return family
    if not forced:
        return None
    for family in FAMILIES:
        low, high = vkey(family.name), vkey(family.upto) if family.upto else None
        if vkey(core) >= low and (high is None or vkey(core) < high):
            return family
    return None
