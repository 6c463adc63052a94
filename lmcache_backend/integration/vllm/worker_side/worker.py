"""Worker side: blend claimed prompts into vLLM's paged cache, store the segments of prompts.

Before a step's forward pass (``start_load_kv``), each claimed request is blended with the
model's own weights (through :class:`~lmcache_backend.models.vllm.VLLMModelAdapter`) into its
blocks (:mod:`.loads`, through a :mod:`.paged_target`); tokens vLLM's prefix cache already holds
are read back from the paged cache and reused as they are. After the forward pass
(``wait_for_save``), prompts whose K/V are complete are read back and their segments stored
(:mod:`.saves`), whichever path computed them. Each load leaves a record (:mod:`.stats`).

The pieces are built once the model is known (:meth:`WorkerSide.register_kv_caches`, or the first
step on releases that create the connector before loading the model): the layout of the paged
cache (:mod:`.layouts`), the attention kernels (:mod:`.attention_choice`), one blender for every
request (each load brings its own settings), and the store.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

import torch

from lmcache_backend.blend import LMCBlender, SegmentCache
from lmcache_backend.blend.request import BlendResult
from lmcache_backend.device import detect_platform
from lmcache_backend.integration.vllm.layouts import (
    CpuLayout,
    LayerCache,
    PagedLayout,
    backend_name_of,
    layout_for,
)
from lmcache_backend.integration.vllm.metadata import LoadSpec, SaveSpec
from lmcache_backend.integration.vllm.model_tracker import ENGINE_NAME, ModelTracker
from lmcache_backend.integration.vllm.reporting.metrics import CacheBlendStats
from lmcache_backend.integration.vllm.reporting.stats import BlendRecord, BlendStats, LoadTiming
from lmcache_backend.integration.vllm.settings import ConnectorSettings
from lmcache_backend.integration.vllm.worker_side import startup_checks, tensor_parallel
from lmcache_backend.integration.vllm.worker_side.attention_choice import choose_attention
from lmcache_backend.integration.vllm.worker_side.loads import Loads
from lmcache_backend.integration.vllm.worker_side.paged_target import PagedCacheTarget
from lmcache_backend.integration.vllm.worker_side.saves import SegmentSaver
from lmcache_backend.models.base import ModelAdapter
from lmcache_backend.models.vllm import VLLMModelAdapter
from lmcache_backend.ops import Ops, get_ops
from lmcache_backend.storage import create_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from lmcache_backend.compat.profile import VllmProfile

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class WorkerSide:
    """The worker-side state: the model adapter, the paged caches, the blender and the store."""

    def __init__(
        self,
        settings: ConnectorSettings,
        vllm_config: VllmConfig,
        profile: VllmProfile,
        platform: str | None = None,
    ) -> None:
        """``platform``: whose cache layout to expect (``"cuda"``, ``"npu"``, ``"cpu"``);
        None: the one this process runs on. Given, it lets the device path run over CPU
        tensors (Triton's interpreter, the Ascend emulation)."""
        self.settings = settings
        self.platform = platform or detect_platform()
        self.vllm_config = vllm_config
        self.profile = profile
        self.block_size = int(vllm_config.cache_config.block_size)
        # one per layer: a tensor, or a (k_cache, v_cache) pair on vllm-ascend
        self.caches: list[LayerCache] = []
        self.layer_names: list[str] = []
        self.layout: PagedLayout | None = None
        self.model: ModelAdapter | None = None
        self.store = None
        self.stats: BlendStats | None = None
        self.saver: SegmentSaver | None = None
        self.loads: Loads | None = None
        self.rank = 0
        # what the metrics have already counted: records, the store's cumulative stats
        self._records_counted = 0
        self._store_counted: dict = {}

    # -- set-up ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, LayerCache]) -> None:
        """Order the layers' caches by layer index (``model.layers.<i>.self_attn.attn``)."""
        indexed = []
        for name, cache in kv_caches.items():
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
            indexed.append((int(match.group(1)), name, cache))
        indexed.sort()
        self.layer_names = [name for _, name, _ in indexed]
        self.caches = [cache for _, _, cache in indexed]
        # load the op set now (the CPU backend builds its kernel, about 30 s the first time on a
        # machine), not in the first blended request's time to first token
        self._ops()
        if self.profile.kv_transfer_after_model_load:
            self._ensure_ready()

    def _ensure_ready(self) -> None:
        """Build everything that needs the model (once): the engine's loaded model, seen
        through the vLLM adapter."""
        if self.model is None:
            self.build(VLLMModelAdapter(ModelTracker.get_model(ENGINE_NAME), self.vllm_config))

    def build(self, model: ModelAdapter) -> None:
        """Build the layout, the attention kernels, the store and the blender for ``model``
        (the engine's model as an adapter) over the registered caches.

        Raises:
            RuntimeError: no caches were registered, their number is not the model's layer
                count, or re-rotated keys would not equal fresh ones for this model.
        """
        if not self.caches:
            raise RuntimeError("CacheBlend: no KV caches were registered")
        settings = self.settings
        if len(self.caches) != model.num_layers:
            raise RuntimeError(
                f"CacheBlend: {len(self.caches)} KV caches for {model.num_layers} layers"
            )
        startup_checks.check_rerotation(model, self.vllm_config)
        ops = self._ops()
        self.layout = self._make_layout(model, ops)
        attention = choose_attention(
            settings, self.vllm_config, self.layer_names, self.caches, self.layout, model, ops
        )
        target = PagedCacheTarget(self.layout, self.caches, attention)
        self.store = self._make_store(model)
        blender = LMCBlender(
            self.store,
            target,
            settings.config,
            model,
            settings.separator,
            ops,
            score_reducer=tensor_parallel.summed_over_ranks if settings.tp_size > 1 else None,
        )
        self.stats = BlendStats(model.num_layers, settings.stats_file, settings.time_phases)
        segments = SegmentCache(self.store, model.fingerprint, settings.separator)
        self.saver = SegmentSaver(segments, self.read_rows, self.block_size, model, ops)
        self.loads = Loads(
            blender,
            target,
            self.read_rows,
            self.block_size,
            settings.blend_layers_per_step,
            settings.time_phases,
            self._loaded,
        )
        self.model = model
        logger.info(
            "CacheBlend worker ready: %s, %d layers, %s layout, ops %s",
            model.fingerprint.architecture,
            model.num_layers,
            type(self.layout).__name__,
            ops.name,
        )
        if settings.verify_on_start:
            startup_checks.verify_on_start(model, self.vllm_config, settings, ops)

    def _ops(self) -> Ops:
        ops = get_ops(self.settings.config.backend)
        return tensor_parallel.consistent_ops(ops) if self.settings.tp_size > 1 else ops

    def _make_store(self, model: ModelAdapter) -> Any:
        rank = self.rank = tensor_parallel.rank(self.settings.tp_size)
        # the blender only reads its hits (it copies them into one buffer per request): memory
        # tiers need not copy each hit first, unless the user's extra_config says otherwise
        config = self.settings.config
        config = config.replace(extra_config={"copy_on_get": False, **config.extra_config})
        return create_store(
            config,
            model.device,
            fingerprint=model.fingerprint,
            num_kv_heads=model.num_kv_heads,
            shard=self.settings.shard(rank),
            instance_id=self.settings.rank_instance(rank),
        )

    def _make_layout(self, model: ModelAdapter, ops: Ops) -> PagedLayout:
        cache = self.caches[0]
        context = self.vllm_config.compilation_config.static_forward_context
        if self.platform == "cpu":
            layer = context[self.layer_names[0]]
            return CpuLayout(
                self.profile.cpu_cache_writer(),
                str(layer.isa),
                num_kv_heads=int(cache.shape[1]),
                block_size=int(cache.shape[2]),
                head_dim=model.head_dim,
                dtype=cache.dtype,
                k_scale=float(getattr(layer, "_k_scale_float", 1.0)),
                v_scale=float(getattr(layer, "_v_scale_float", 1.0)),
                kv_cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
            )
        return layout_for(
            cache,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            block_size=self.block_size,
            backend_name=backend_name_of(context.get(self.layer_names[0])),
            ops=ops,
        )

    def read_rows(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's ``[N, Hkv, D]`` K/V at ``slots [N]`` of the paged cache."""
        keys, values = [], []
        for cache in self.caches:
            k, v = self.layout.read(cache, slots)
            keys.append(k)
            values.append(v)
        return keys, values

    # -- the step -------------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> BlendRecord:
        """Blend ``spec``'s prompt and write tokens ``prefix_len..end-1`` into its blocks."""
        self._ensure_ready()
        return self.loads.load(spec)

    def start(self, spec: LoadSpec) -> None:
        """Start ``spec``'s sliced blend; it advances in :meth:`advance`."""
        self._ensure_ready()
        self.loads.start(spec)

    def cancel(self, req_id: str) -> None:
        """Drop the sliced blend of a request finished while it was in flight."""
        if self.loads is not None:
            self.loads.cancel(req_id)

    def advance(self) -> None:
        """Advance the sliced blends in flight by ``blend_layers_per_step`` layer passes."""
        if self.loads is not None and self.loads.sliced:
            self.loads.advance(self.model.num_layers - 1)

    def finished(self, req_ids: Any) -> None:
        """vLLM reports these requests finished or aborted (``get_finished``): forget them.
        The worker keeps two things per request: a sliced blend in flight (:class:`.Loads`,
        ended when it completes or by the scheduler's cancel, which comes first) and the rows a
        blend reused, kept for the prompt's save (:class:`.SegmentSaver`), dropped here."""
        if self.saver is not None:
            for rid in req_ids or ():
                self.saver.forget(rid)

    def take_finished_loads(self) -> set[str] | None:
        """Sliced loads completed or cancelled since the last call (``finished_recving``)."""
        return None if self.loads is None else self.loads.take_finished()

    def _loaded(
        self,
        spec: LoadSpec,
        result: BlendResult,
        paged_layers: int,
        timing: LoadTiming,
        phases: dict[str, float],
    ) -> BlendRecord:
        """A load completed: keep its reused rows for the save, record it."""
        self.saver.blended(spec.req_id, result.valid_mask, spec.prefix_len)
        return self.stats.record(spec, result, paged_layers, timing, phases)

    def finish_step(self) -> None:
        """After the step's forward pass: report the timed records with vLLM's step time."""
        if self.stats is not None:
            self.stats.finish_step()

    def save(self, spec: SaveSpec) -> int:
        """Store the segments of ``spec``'s prompt the store lacks; returns how many."""
        self._ensure_ready()
        return self.saver.save(spec)

    def take_metrics(self) -> CacheBlendStats | None:
        """The blends and store activity since the last call, for vLLM's metrics (None:
        nothing new). Only tensor-parallel rank 0 reports: every rank blends the same requests."""
        if self.stats is None or self.rank != 0:
            return None
        out = CacheBlendStats()
        records = self.stats.records
        for record in records[self._records_counted :]:
            if record.fallback_reason is not None:
                out.inc("vllm:cacheblend_blend_fallbacks")
                continue
            out.inc("vllm:cacheblend_requests_blended")
            out.inc("vllm:cacheblend_prompt_tokens", record.num_tokens)
            out.inc(
                "vllm:cacheblend_reused_tokens", record.num_reusable - record.recomputed_reusable
            )
            out.inc("vllm:cacheblend_recomputed_tokens", record.recomputed_reusable)
            out.observe("vllm:cacheblend_blend_seconds", record.blend_ms / 1000.0)
            out.observe("vllm:cacheblend_recompute_share", record.recompute_fraction)
            if record.read_share is not None:
                out.observe("vllm:cacheblend_read_share", record.read_share)
            if record.divergence is not None:
                out.observe("vllm:cacheblend_divergence", record.divergence)
        self._records_counted = len(records)
        store = self.store.stats() if hasattr(self.store, "stats") else {}
        last = self._store_counted
        for key, name in (
            ("hits", "vllm:cacheblend_store_hits"),
            ("stored", "vllm:cacheblend_store_stored"),
            ("stored_bytes", "vllm:cacheblend_store_stored_bytes"),
            ("evicted", "vllm:cacheblend_store_evictions"),
            ("refused", "vllm:cacheblend_store_refused"),
            ("replaced", "vllm:cacheblend_store_replaced"),
            ("admission_skipped", "vllm:cacheblend_store_admission_skipped"),
        ):
            for tier, value in store.get(key, {}).items():
                out.inc(name, value - last.get(key, {}).get(tier, 0), tier)
        out.inc("vllm:cacheblend_store_misses", store.get("misses", 0) - last.get("misses", 0))
        for tier, value in store.get("bytes", {}).items():
            if value != last.get("bytes", {}).get(tier):  # a gauge: sent when it changes
                out.set_gauge("vllm:cacheblend_store_bytes", value, tier)
        before = last.get("remote_nodes", {})
        for node, now in store.get("remote_nodes", {}).items():
            was = before.get(node, {})
            for key in ("outages", "reconnects", "refused"):
                out.inc(f"vllm:cacheblend_remote_{key}", now[key] - was.get(key, 0), node)
            if now["up"] != was.get("up"):
                out.set_gauge("vllm:cacheblend_remote_up", now["up"], node)
        self._store_counted = store
        return None if out.is_empty() else out

    @property
    def records(self) -> list[BlendRecord]:
        return [] if self.stats is None else self.stats.records

    def shutdown(self) -> None:
        """Close the store and remove its index folder (the next start rebuilds it from the
        tiers; a disk tier's files stay). vLLM may end a worker without calling this (SIGTERM):
        the folder is then removed when the process exits, or by the next start
        (:mod:`lmcache_backend.storage.lookup.index_dir`)."""
        store = self.store
        if store is None:
            return
        store.close()
        index = getattr(store, "index", None)
        if index is not None and hasattr(index, "remove"):
            index.remove()
