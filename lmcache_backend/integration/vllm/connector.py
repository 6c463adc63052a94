"""``CacheBlendConnector``: CacheBlend as a vLLM v1 KV connector.

Use::

    KVTransferConfig(
        kv_connector="CacheBlendConnector",
        kv_connector_module_path="lmcache_backend.integration.vllm.connector",
        kv_role="kv_both",
    )

Settings come from ``LMCACHE_CONFIG_FILE`` / ``LMCACHE_*`` (``kv_connector_extra_config`` on top);
an invalid one fails engine start-up with a message naming it. The scheduler side
(:mod:`.scheduler`) decides which prompts to claim; the worker side (:mod:`.worker`) blends them
into the paged cache and stores segments. The two may live in different processes; they share the
store's cross-process index.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache_backend.compat.gate import admit
from lmcache_backend.compat.vllm import SLICED_FIRST_RELEASE, SLICED_VERIFIED_RELEASE
from lmcache_backend.config import ConfigError
from lmcache_backend.integration.vllm.layouts import LayerCache
from lmcache_backend.integration.vllm.metadata import CacheBlendMetadata
from lmcache_backend.integration.vllm.reporting.metrics import (
    CacheBlendPromMetrics,
    CacheBlendStats,
)
from lmcache_backend.integration.vllm.scheduler_side.scheduler import SchedulerSide
from lmcache_backend.integration.vllm.settings import ConnectorSettings, load_settings
from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide
from lmcache_backend.models.vllm import vllm_fingerprint
from lmcache_backend.settings import read_variable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from lmcache_backend.compat.profile import VllmProfile

logger = logging.getLogger(__name__)


def _route_logs_like_vllm() -> None:
    """Show this package's INFO lines (claims, blends) in vLLM's output: the package logger has
    no handler of its own, and the root logger's default level would hide them."""
    pkg = logging.getLogger("lmcache_backend")
    if pkg.handlers or pkg.level != logging.NOTSET:
        return  # the application configured logging itself
    level = str(read_variable("VLLM_LOGGING_LEVEL")).strip().upper()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    pkg.addHandler(handler)
    pkg.setLevel(getattr(logging, level, logging.INFO))
    pkg.propagate = False


def _resolve_auto_slicing(settings: ConnectorSettings, profile: VllmProfile) -> ConnectorSettings:
    """``blend_layers_per_step="auto"`` slices long claims only on the vLLM release whose
    asynchronous loads were checked; elsewhere every blend runs at once (logged)."""
    if not settings.slicing_auto:
        return settings
    if profile.sliced_loads and profile.release == SLICED_VERIFIED_RELEASE:
        logger.info(
            "CacheBlend: claims of %d tokens or more are blended %d layer passes per step "
            "(blend_layers_per_step=auto), shorter ones at once",
            settings.slice_from_tokens,
            settings.blend_layers_per_step,
        )
        return settings
    logger.info(
        "CacheBlend: blends run at once (blend_layers_per_step=auto slices them on vLLM %s "
        "only; this is %s)",
        SLICED_VERIFIED_RELEASE,
        profile.release,
    )
    return dataclasses.replace(settings, blend_layers_per_step=0, slice_from_tokens=0)


class CacheBlendConnectorMetadata(KVConnectorMetadata, CacheBlendMetadata):
    """The step's load/save plan (:class:`CacheBlendMetadata`) as vLLM's metadata type."""


class CacheBlendConnector(KVConnectorBase_V1):
    """CacheBlend for vLLM; see the module docstring.

    Args:
        vllm_config: the engine configuration.
        role: scheduler or worker.
        kv_cache_config: passed by vLLM releases whose connectors take it (unused).

    Raises:
        ConfigError: an invalid ``LMCACHE_*`` / extra-config setting.
        UnsupportedVersions: the version gate refuses the installed vLLM / vllm-ascend / LMCache
            on this platform (:mod:`lmcache_backend.compat.gate`; one line naming what to
            install).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        _route_logs_like_vllm()
        settings = load_settings(vllm_config)
        # the gate, applied once for this process: the model adapter reads what it admits
        profile = admit(settings.allow_untested_versions)
        settings = _resolve_auto_slicing(settings, profile)
        if settings.blend_layers_per_step and not profile.sliced_loads:
            raise ConfigError(
                f"blend_layers_per_step={settings.blend_layers_per_step}: sliced loads need "
                f"vLLM's update_connector_output (vLLM {SLICED_FIRST_RELEASE} and later); this "
                f"is vLLM {profile.release}"
            )
        if "kv_cache_config" in profile.connector_init_params:
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        else:  # releases before 0.11.2 (compat/vllm.py): two arguments
            super().__init__(vllm_config, role)  # type: ignore[call-arg]
        self.settings = settings
        self.profile = profile
        if settings.blend_layers_per_step and profile.release != SLICED_VERIFIED_RELEASE:
            logger.warning(
                "blend_layers_per_step=%d relies on vLLM's asynchronous KV loads, verified with "
                "vLLM %s only (this is %s)",
                settings.blend_layers_per_step,
                SLICED_VERIFIED_RELEASE,
                profile.release,
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(settings, vllm_fingerprint(vllm_config), profile)
        else:
            self._worker = WorkerSide(settings, vllm_config, profile)
        logger.info(
            "CacheBlendConnector (%s, vLLM %s, %s code path): enable_blending=%s, ratios=%s, "
            "selection=%s (span %d), check layers=%s, blend_min_tokens=%d, instance %s",
            role.name.lower(),
            profile.release,
            profile.name,
            settings.config.enable_blending,
            settings.config.blend_recompute_ratios,
            settings.config.blend_selection,
            settings.config.blend_selection_span,
            settings.config.blend_check_layers,
            settings.config.blend_min_tokens,
            settings.instance_id,
        )
        if role == KVConnectorRole.SCHEDULER:
            logger.info(
                "CacheBlend segmentation (blend_segmentation=%s): %s; a request is blended when "
                "it reuses >= %d tokens and its predicted cost is <= %g of a full prefill",
                settings.config.blend_segmentation,
                settings.separator.describe(),
                settings.config.blend_min_tokens,
                settings.config.blend_max_cost,
            )

    @property
    def _sched(self) -> SchedulerSide:
        """The scheduler side: vLLM calls the scheduler's hooks on a scheduler connector only."""
        assert self._scheduler is not None, "a scheduler hook called on a worker connector"
        return self._scheduler

    @property
    def _work(self) -> WorkerSide:
        """The worker side: vLLM calls the worker's hooks on a worker connector only."""
        assert self._worker is not None, "a worker hook called on a scheduler connector"
        return self._worker

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        # Synchronous (vLLM runs the load before the step's forward pass) unless the claim is
        # sliced (blend_layers_per_step): then vLLM parks the request until finished_recving.
        claimed = self._sched.num_new_matched_tokens(request, num_computed_tokens)
        return claimed, claimed > 0 and self._sched.is_sliced(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        block_ids = None
        if num_external_tokens and self._sched.is_sliced(request):
            block_ids = blocks.get_block_ids()[0]
        self._sched.after_alloc(request, num_external_tokens, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan = self._sched.build(scheduler_output)
        return CacheBlendConnectorMetadata(loads=plan.loads, saves=plan.saves, cancels=plan.cancels)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.loads_finished(getattr(connector_output, "finished_recving", None))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._sched.finished(request)
        return False, None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, LayerCache]) -> None:
        self._work.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # A step with a synchronous load runs this before its forward pass; a step with sliced
        # loads only (or no tokens at all) after it (vLLM's _get_kv_connector_output,
        # kv_connector_no_forward). Sliced loads start first, then cancels drop blends of
        # aborted requests, and only then do the blends in flight advance.
        meta = self.profile.step_metadata(self)
        for spec in getattr(meta, "loads", ()):
            if spec.sliced:
                self._work.start(spec)
            else:
                self._work.load(spec)
        for req_id in getattr(meta, "cancels", ()):
            self._work.cancel(req_id)
        self._work.advance()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads complete inside start_load_kv, before the forward pass.
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # finished_recving: sliced loads completed (or cancelled) this step
        self._work.finished(finished_req_ids)
        return None, self._work.take_finished_loads()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Segments are read back from the paged cache once the whole prompt is in it.
        return

    def wait_for_save(self) -> None:
        self._work.finish_step()
        meta = self.profile.step_metadata(self)
        for spec in getattr(meta, "saves", ()):
            self._work.save(spec)

    # -- metrics (vLLM's /metrics; see .metrics) ---------------------------------------------

    def get_kv_connector_stats(self) -> CacheBlendStats | None:
        # vLLM calls this after every step on both sides: each hands over what is new
        if self._scheduler is not None:
            return self._scheduler.take_metrics()
        return self._work.take_metrics()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> CacheBlendStats:
        # a copy: vLLM's log accumulator adds later intervals into the object it is given
        return CacheBlendStats(data=copy.deepcopy(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> CacheBlendPromMetrics:
        return CacheBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
