"""Every place this package touches LMCache: one glue class per LMCache release family.

Each glue class reaches LMCache only through the symbols its family declares
(:mod:`lmcache_backend.compat.lmcache`), by key: :meth:`Glue.resolve` imports a declared module
and follows a declared name, :meth:`Glue.name` gives the attribute or method name to use on an
LMCache object. Removing a declaration therefore breaks the glue, and the contract tests check
every declaration against the release's source.

What a glue installs (:meth:`Glue.replacements`):

* ``LMCBlenderBuilder.get_or_create``: builds :class:`LMCacheBlender` (signature per family);
* the positional-encoding factory ``get_fused_rope`` the layerwise model calls;
* the attention factory the layerwise model calls (a class in 0.3.3, a function later);
* ``lmcache.blend.executor.CacheBlendImpl`` where the legacy API ships (0.3.3, 0.3.7).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Generator
from typing import Any, ClassVar

import torch

from lmcache_backend.compat.lmcache import (
    FAMILY_0_3_3,
    FAMILY_0_3_7,
    FAMILY_0_3_12,
    LMCacheFamily,
    Symbol,
)
from lmcache_backend.config import BlendConfig, load_config
from lmcache_backend.integration.lmcache import blending, hooks
from lmcache_backend.ops import get_ops

logger = logging.getLogger(__name__)

# Allows an LMCache release outside the version matrix (declared in the settings registry).
FORCE_ENV = "LMCACHE_BACKEND_FORCE_LMCACHE"


class Glue:
    """Glue for one family; subclasses fill :attr:`family` and the differing behaviour."""

    family: ClassVar[LMCacheFamily]

    # -- symbol access ----------------------------------------------------------------------

    def symbol(self, key: str) -> Symbol:
        return self.family.symbol(key)

    def name(self, key: str) -> str:
        """The attribute or method name of the declared symbol ``key``."""
        return self.symbol(key).attr

    def owner_of(self, key: str) -> Any:
        """The module or class holding symbol ``key`` (imports LMCache)."""
        sym = self.symbol(key)
        target: Any = importlib.import_module(sym.module)
        if sym.owner:
            for part in sym.owner.split("."):
                target = getattr(target, part)
        return target

    def resolve(self, key: str) -> Any:
        """The live object of symbol ``key`` (imports LMCache)."""
        return getattr(self.owner_of(key), self.name(key))

    # -- what installing changes ------------------------------------------------------------

    def replacements(self, ops_name: str | None) -> dict[str, Any]:
        """symbol key -> the object bound in its place while installed."""
        out = {
            "builder_get_or_create": classmethod(self.make_get_or_create()),
            "rope_hook": hooks.fused_rope_factory(ops_name),
            "attn_hook": self.attention_hook(ops_name),
        }
        if self.family.has_legacy_blend:
            out["legacy_executor"] = hooks.LegacyCacheBlendImpl
        return out

    def attention_hook(self, ops_name: str | None) -> Any:
        return hooks.attention_factory(ops_name)

    def make_get_or_create(self) -> Any:
        raise NotImplementedError

    def _get_or_create(
        self, builder: Any, instance_id: str, cache_engine: Any, gpu_connector: Any, config: Any
    ) -> LMCacheBlender:
        blenders = getattr(builder, self.name("builder_blenders"))
        if instance_id not in blenders:
            logger.info("lmcache_backend: creating the CacheBlend blender for %s", instance_id)
            vllm_model = self.resolve("tracker_get_model")(instance_id)
            blenders[instance_id] = LMCacheBlender(
                self, cache_engine, gpu_connector, vllm_model, config
            )
        return blenders[instance_id]

    def forget_blenders(self) -> int:
        """Drop the blenders this package created from LMCache's builder; returns how many."""
        blenders = self.resolve("builder_blenders")
        ours = [key for key, value in blenders.items() if isinstance(value, LMCacheBlender)]
        for key in ours:
            del blenders[key]
        return len(ours)

    # -- behaviour that differs per family ----------------------------------------------------

    def engine_settings(self, cache_engine: Any, config: Any) -> dict[str, Any]:
        """Blend settings from LMCache's engine configuration (keys of this package's config)."""
        raise NotImplementedError

    def build_layerwise_model(self, vllm_model: Any, blender: Any, config: Any) -> Any:
        raise NotImplementedError

    def update_attn_metadata(self, attn_metadata: Any, kept: torch.Tensor) -> None:
        raise NotImplementedError


class Glue033(Glue):
    """LMCache 0.3.3: no config reaches the blender; metadata fields are set directly."""

    family = FAMILY_0_3_3

    def make_get_or_create(self) -> Any:
        glue = self

        def get_or_create(cls: Any, instance_id: str, cache_engine: Any, gpu_connector: Any):
            return glue._get_or_create(cls, instance_id, cache_engine, gpu_connector, None)

        return get_or_create

    def attention_hook(self, ops_name: str | None) -> Any:
        return hooks.attention_class(ops_name)

    def engine_settings(self, cache_engine: Any, config: Any) -> dict[str, Any]:
        engine_config = getattr(cache_engine, self.name("engine_config"), None)
        out: dict[str, Any] = {}
        ratio = getattr(engine_config, self.name("config_ratio"), None)
        if ratio is not None:
            out["blend_recompute_ratios"] = [ratio]
        min_tokens = getattr(engine_config, self.name("config_min_tokens"), None)
        if min_tokens is not None:
            out["blend_min_tokens"] = min_tokens
        return out

    def build_layerwise_model(self, vllm_model: Any, blender: Any, config: Any) -> Any:
        return self.resolve("infer_model")(vllm_model, blender)

    def update_attn_metadata(self, attn_metadata: Any, kept: torch.Tensor) -> None:
        num = int(kept.numel())
        qsl = getattr(attn_metadata, self.name("attn_metadata_qsl"))
        setattr(attn_metadata, self.name("attn_metadata_mql"), num)
        setattr(
            attn_metadata,
            self.name("attn_metadata_qsl"),
            torch.tensor([0, num], dtype=qsl.dtype, device=qsl.device),
        )


class Glue037(Glue):
    """LMCache 0.3.7: the engine config reaches the blender; metadata updates itself."""

    family = FAMILY_0_3_7

    def make_get_or_create(self) -> Any:
        glue = self

        def get_or_create(
            cls: Any, instance_id: str, cache_engine: Any, gpu_connector: Any, config: Any
        ):
            return glue._get_or_create(cls, instance_id, cache_engine, gpu_connector, config)

        return get_or_create

    def engine_settings(self, cache_engine: Any, config: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for ours, key in (
            ("blend_check_layers", "config_check_layers"),
            ("blend_recompute_ratios", "config_ratios"),
            ("blend_min_tokens", "config_min_tokens"),
        ):
            value = getattr(config, self.name(key), None)
            if value is not None:
                out[ours] = value
        return out

    def build_layerwise_model(self, vllm_model: Any, blender: Any, config: Any) -> Any:
        extra = getattr(config, self.name("config_extra"), None) or {}
        return self.resolve("infer_model")(vllm_model, blender, bool(extra.get("enable_sparse")))

    def update_attn_metadata(self, attn_metadata: Any, kept: torch.Tensor) -> None:
        getattr(attn_metadata, self.name("attn_metadata_update"))(kept)


class Glue0312(Glue037):
    """LMCache 0.3.12: as 0.3.7, with the model loop in ``models.base``; no legacy API."""

    family = FAMILY_0_3_12


GLUES: dict[str, type[Glue]] = {g.family.name: g for g in (Glue033, Glue037, Glue0312)}


def glue_for(family: LMCacheFamily) -> Glue:
    return GLUES[family.name]()


class LMCacheBlender:
    """The blender LMCache's connector drives (``blend``, ``blend_layer``, ``process_qkv``).

    LMCache supplies storage, retrieval into its GPU buffer and the layerwise model loop; this
    object selects tokens and blends K/V with this package's ops, and the installed hooks give
    the loop this package's key re-rotation and exact-mask attention.

    Args:
        glue: the family's glue.
        cache_engine: LMCache's engine; gpu_connector: its layerwise buffer connector.
        vllm_model: the model registered in LMCache's ``VLLMModelTracker``.
        config: LMCache's engine config (None in 0.3.3, where the engine's is read).
    """

    def __init__(self, glue: Glue, cache_engine: Any, gpu_connector: Any, vllm_model: Any, config):
        self.glue = glue
        self.cache_engine = cache_engine
        self.gpu_connector = gpu_connector
        self.settings = _settings(glue.engine_settings(cache_engine, config))
        self.ops = get_ops(self.settings.backend)
        self.layerwise_model = glue.build_layerwise_model(vllm_model, self, config)
        self.num_layers = len(vllm_model.model.layers)
        self.settings.validate_for_model(self.num_layers)
        self.state: blending.RequestState | None = None
        self._rotary = [layer.self_attn.rotary_emb for layer in vllm_model.model.layers]
        for attn in getattr(self.layerwise_model, "lmc_attn_layers", []):
            if isinstance(attn, hooks.ExactMaskAttention):
                attn.positions = self

    # -- called by the attention hook ----------------------------------------------------------

    def query_positions(self, num_queries: int, device: torch.device) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("CacheBlend attention ran outside a blended request")
        positions = self.state.active_positions
        if positions.numel() != num_queries:
            raise RuntimeError(f"{num_queries} queries for {positions.numel()} active tokens")
        return positions.to(device)

    # -- LMCache's blender interface -------------------------------------------------------------

    def process_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        residual: torch.Tensor,
        layer_id: int,
        attn_output: torch.Tensor | None,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """One layer: ``q [N, Hq*D]``, ``k, v [N, Hkv*D]`` before RoPE (LMCache's contract).

        Returns ``(q, k, v, residual, attn_output, attn_metadata)`` with ``k, v [T, Hkv*D]`` the
        blended rows of every token (LMCache's buffer, which it then pages in).
        """
        cached_k, cached_v = getattr(self.gpu_connector, self.glue.name("gpu_get_kv"))(layer_id)
        if self.state is None:
            gaps = getattr(self.gpu_connector, self.glue.name("gpu_gap_positions"), None)
            self.state = blending.begin_request(q.shape[0], gaps, self.settings, cached_k.device)
        if attn_output is None:
            attn_output = torch.empty_like(q)
        q, k = self._rotary[layer_id](self.state.active_positions, q, k)
        q, k, v, residual, attn_output, kept = blending.blend_step(
            self.ops, self.state, layer_id, q, k, v, residual, attn_output, cached_k, cached_v
        )
        if kept is not None:
            self.glue.update_attn_metadata(attn_metadata, kept)
        return q, k, v, residual, attn_output, attn_metadata

    def blend_layer(
        self, tokens: torch.Tensor, mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Generator[None, None, None]:
        """Retrieve and compute layer by layer; yields ``num_layers + 2`` times, as LMCache's.

        Retrieval runs one layer ahead of compute: layer ``i``'s cached K/V are in the buffer
        (re-rotated) when layer ``i`` is computed, and LMCache pages them in two steps later.
        """
        retrieve = getattr(self.cache_engine, self.glue.name("engine_retrieve_layer"))
        compute = getattr(self.layerwise_model, self.glue.name("model_compute_layer"))
        self.state = None
        executor = compute(tokens)
        retriever = retrieve(tokens, mask, **kwargs)
        try:
            next(retriever)
            yield
            for _ in range(self.num_layers):
                next(retriever)
                next(executor)
                yield
            next(retriever)
        finally:
            if self.state is not None:
                logger.debug(
                    "CacheBlend: %d reusable tokens, %d token-layers computed",
                    self.state.num_reusable,
                    self.state.token_layers,
                )
            self.state = None
        yield

    def blend(
        self, tokens: torch.Tensor | list[int], mask: torch.Tensor | None = None, **kwargs: Any
    ) -> None:
        """Blend one request into the engine's KV cache (``kwargs``: ``kvcaches``,
        ``slot_mapping``, as LMCache's connector passes them)."""
        tokens = torch.as_tensor(tokens)
        for _ in self.blend_layer(tokens, mask, **kwargs):
            pass


def _settings(engine_values: dict[str, Any]) -> BlendConfig:
    """This package's configuration, with the blend keys LMCache's engine config sets."""
    config = load_config()
    return config.replace(**engine_values) if engine_values else config
