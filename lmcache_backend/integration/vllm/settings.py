"""The connector's settings, read the LMCache way, shared by its scheduler and worker sides.

Sources: ``LMCACHE_CONFIG_FILE`` / ``LMCACHE_*`` environment variables, then vLLM's
``kv_connector_extra_config`` on top, which also holds the connector's own keys. Per request,
``kv_transfer_params`` may carry ``{"blend": false}`` (no reuse for this request) and the
per-request engine keys (``blend_recompute_ratios``, ``blend_check_layers``, ``blend_selection``).
Every key is declared in the settings registry (:mod:`lmcache_backend.settings`). A malformed
per-request value never fails the engine: it is logged (WARNING, naming the request, key and
value) and the engine's settings apply.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_backend.blend.segments.patterns import SegmentPattern, segment_pattern
from lmcache_backend.config import BlendConfig, ConfigError, load_config
from lmcache_backend.logtext import shorten, shown
from lmcache_backend.settings import CONNECTOR, ENGINE, REQUEST, parse_given, setting_field
from lmcache_backend.settings.vllm_keys import SKIP_SAVE, STALENESS_PROBES
from lmcache_backend.storage.lookup.index_dir import default_index_dir
from lmcache_backend.storage.settings import store_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

#: where the connector's own keys come from (errors name it)
EXTRA_CONFIG = "kv_connector_extra_config"
#: layer passes per engine step of a sliced blend with ``blend_layers_per_step="auto"``
AUTO_LAYERS_PER_STEP = 8
#: vLLM's step budget in tokens where its scheduler config does not say
DEFAULT_STEP_TOKENS = 8192
#: connector keys whose value the settings hold worked out (not as given)
_RESOLVED = ("instance_id", "blend_layers_per_step")


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything both connector sides derive from the engine's configuration.

    One field per connector key of the settings registry
    (:mod:`lmcache_backend.settings.vllm_keys`, where each is described; the fields between the
    markers are generated from it by ``lmcache-backend config --docs``), and:

    Attributes:
        config: the validated blend configuration.
        instance_id: names this engine's cross-process segment index (scheduler and workers):
            the key's value, else ``vllm-<engine_id>``.
        tp_size: tensor-parallel ranks; each keeps its own store shard and index.
        separator: how prompts split into cached units, derived from the model's tokenizer
            at start-up: ``blend_special_str`` as the ids it produces inside text, or, when it
            is empty, blocks of ``blend_block_size`` tokens found at any offset.
        num_layers: the model's decoder layers (a request's check layers must exist).
        blend_layers_per_step: layer passes per step of a sliced blend; 0: every claim is
            blended at once (the key's ``"auto"`` becomes :data:`AUTO_LAYERS_PER_STEP`).
        slice_from_tokens: the shortest claim that is sliced: 0 with a number of layers per
            step (every claim), vLLM's ``max_num_batched_tokens`` with ``"auto"``: a blend
            longer than one of vLLM's own prefill steps is sliced, a shorter one (which stalls
            the other requests less than a prefill of the same prompt would) runs at once,
            where slicing would cost it a fifth to a third more time to first token.
        slicing_auto: ``blend_layers_per_step`` was ``"auto"`` (the connector turns it to 0,
            with a log line, where vLLM's asynchronous loads are not verified).
    """

    config: BlendConfig
    instance_id: str
    tp_size: int
    separator: SegmentPattern
    # <settings-fields: dataclass connector except instance_id,blend_layers_per_step>
    #: append one JSON line per request the connector saw
    stats_file: str | None = setting_field(CONNECTOR["stats_file"])
    #: run a vLLM / vllm-ascend release the version gate has no record of, with the nearest code
    #: path
    allow_untested_versions: bool = setting_field(CONNECTOR["allow_untested_versions"])
    #: run `lmcache-backend verify`'s model checks once at start-up and log the result
    verify_on_start: bool = setting_field(CONNECTOR["verify_on_start"])
    #: time the phases of each blended request into `stats_file`'s records (`phases_ms`,
    #: milliseconds per phase)
    time_phases: bool = setting_field(CONNECTOR["time_phases"])
    #: run a preview selection's preview and then the selected tokens through vLLM's own compiled
    #: forward pass
    engine_forward: bool = setting_field(CONNECTOR["engine_forward"])
    #: kernel of the selected tokens' attention (vLLM's forward pass and the layer-by-layer path
    #: alike)
    selected_attention: str = setting_field(CONNECTOR["selected_attention"])
    # </settings-fields>
    num_layers: int | None = None
    blend_layers_per_step: int = 0
    slice_from_tokens: int = 0
    slicing_auto: bool = False

    def rank_instance(self, rank: int) -> str:
        """Index id of one rank (the same on the scheduler and on that rank's worker)."""
        return self.instance_id if self.tp_size == 1 else f"{self.instance_id}-tp{rank}"

    def shard(self, rank: int) -> str:
        return "" if self.tp_size == 1 else f"tp{rank}of{self.tp_size}"


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str, revision: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        name, revision=revision, trust_remote_code=trust_remote_code
    )


def load_settings(vllm_config: VllmConfig) -> ConnectorSettings:
    """Read and validate the settings of the engine described by ``vllm_config``.

    Raises:
        ConfigError: a setting is invalid (the message names the key and value), or it does not
            fit the model (e.g. a check layer beyond the last layer).
    """
    kv = vllm_config.kv_transfer_config
    assert kv is not None, "vLLM builds a KV connector from its kv_transfer_config only"
    extra = dict(getattr(kv, "kv_connector_extra_config", None) or {})
    own = parse_given(CONNECTOR, extra, EXTRA_CONFIG)
    config = load_config(**extra)  # the engine keys (it leaves the connector's alone)
    if config.enable_blending and getattr(vllm_config, "lora_config", None) is not None:
        # A segment's K/V depend on the adapter that computed them, which neither the store's
        # key nor the blender's layer calls know: blending would mix adapters silently.
        raise ConfigError(
            "enable_blending=True: CacheBlend does not support LoRA adapters "
            "(vLLM's enable_lora is set); turn one of them off"
        )
    mc = vllm_config.model_config
    num_layers = int(mc.hf_text_config.num_hidden_layers)
    config.validate_for_model(num_layers)
    separator = _pattern(config, mc)
    instance_id = own.pop("instance_id", None) or f"vllm-{kv.engine_id}"
    try:  # it names the index folder: a plain name, checked now rather than in the worker
        default_index_dir(instance_id)
    except ValueError as exc:
        raise CONNECTOR["instance_id"].error(instance_id, EXTRA_CONFIG, str(exc)) from None
    store_settings(config)  # the store's extra_config keys (and the secret file), at start
    layers_per_step = own.pop("blend_layers_per_step", CONNECTOR["blend_layers_per_step"].default)
    return ConnectorSettings(
        config=config,
        instance_id=instance_id,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        separator=separator,
        num_layers=num_layers,
        **own,
        **_slicing(layers_per_step, vllm_config),
    )


def _pattern(config: BlendConfig, mc: Any) -> SegmentPattern:
    """The configured segment pattern. Only a separator needs the model's tokenizer (its ids are
    derived from it); blocks need none, so a model vLLM serves without one (``skip_tokenizer_init``
    with token-id prompts) can use them, and with ``auto`` such a model is cut in blocks only
    (logged). A tokenizer that fails to load otherwise fails the start as before."""
    segmentation, special = config.blend_segmentation, config.blend_special_str
    if special == "" or segmentation == "blocks":
        return segment_pattern(None, special, config.blend_block_size, segmentation)
    try:
        tokenizer = _tokenizer(
            str(mc.tokenizer), getattr(mc, "tokenizer_revision", None), bool(mc.trust_remote_code)
        )
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ...
        if not getattr(mc, "skip_tokenizer_init", False):
            raise
        why = f"{mc.tokenizer} has no tokenizer (vLLM runs with skip_tokenizer_init)"
        if segmentation == "separator":
            where = config.sources.get("blend_segmentation", "default")
            raise ENGINE["blend_segmentation"].error(
                segmentation,
                where,
                f"a separator's token ids come from the model's tokenizer and {why}; "
                "set blend_segmentation=blocks",
            ) from None
        logger.warning(
            "CacheBlend: %s, so blend_special_str %r cannot be matched (%s: %s); prompts are cut "
            "in blocks of %d tokens only, as with blend_segmentation=blocks",
            why,
            special,
            type(exc).__name__,
            shorten(str(exc), 120),
            config.blend_block_size,
        )
        return segment_pattern(None, special, config.blend_block_size, "blocks")
    try:
        return segment_pattern(tokenizer, special, config.blend_block_size, segmentation)
    except ValueError as exc:
        where = config.sources.get("blend_special_str", "default")
        raise ENGINE["blend_special_str"].error(special, where, str(exc)) from exc


def _slicing(value: int | str, vllm_config: VllmConfig) -> dict[str, Any]:
    """``blend_layers_per_step`` (a count, or ``"auto"``) as the settings' slicing fields."""
    if value == "auto":
        scheduler = getattr(vllm_config, "scheduler_config", None)
        step_tokens = getattr(scheduler, "max_num_batched_tokens", None) or DEFAULT_STEP_TOKENS
        return {
            "blend_layers_per_step": AUTO_LAYERS_PER_STEP,
            "slice_from_tokens": int(step_tokens),
            "slicing_auto": True,
        }
    return {"blend_layers_per_step": value, "slice_from_tokens": 0, "slicing_auto": False}


def request_config(
    config: BlendConfig,
    params: Any,
    num_layers: int | None = None,
    request_id: str = "?",
) -> BlendConfig | None:
    """The configuration of one request after its ``kv_transfer_params``; None: do not blend.

    ``params`` comes from the client unchecked (any JSON value). ``{"blend": false}`` opts out;
    the per-request engine keys (``blend_recompute_ratios``, ``blend_check_layers``,
    ``blend_selection``: :data:`~lmcache_backend.settings.REQUEST`) are parsed like the
    engine's settings and the check layers must exist in a model of ``num_layers``.
    Anything invalid (a non-dict, a ``blend`` that is not a boolean, an unparsable or
    out-of-range value, a misspelt ``blend*`` key) is logged as a WARNING naming the request and
    the engine's settings apply: a bad request must never stop the engine. Keys not starting
    with ``blend`` belong to other connectors and are left alone.
    """
    if not config.enable_blending:
        return None
    if not params:
        return config
    if not isinstance(params, dict):
        logger.warning(
            "request %s: ignoring kv_transfer_params %s: expected a JSON object",
            shorten(str(request_id)),
            shown(params),
        )
        return config
    unknown = sorted(k for k in params if str(k).startswith("blend") and k not in REQUEST)
    if unknown:
        logger.warning(
            "request %s: ignoring unknown kv_transfer_params %s (known: %s)",
            shorten(str(request_id)),
            shown(unknown),
            ", ".join(REQUEST),
        )
    if not _request_flag(params, "blend", request_id):
        return None
    given = {k: params[k] for k in REQUEST if k in ENGINE and k in params}
    if not given:
        return config
    try:
        out = config.replace_parsed(parse_given(REQUEST, given, "kv_transfer_params"))
        if num_layers is not None:
            out.validate_for_model(num_layers)
        return out
    except ConfigError as exc:
        logger.warning(
            "request %s: ignoring kv_transfer_params %s: %s; the engine's settings apply",
            shorten(str(request_id)),
            shown(given),
            shorten(str(exc)),
        )
        return config


def skips_save(params: Any, request_id: str = "?") -> bool:
    """Whether a request's ``kv_transfer_params`` hold ``"lmcache.skip_save": true`` (LMCache's
    key): its K/V are not written to the store. An invalid value is logged as a WARNING naming
    the request, and the request is stored as usual."""
    return isinstance(params, dict) and _request_flag(params, SKIP_SAVE, request_id)


def staleness_probes(params: Any, request_id: str = "?") -> int:
    """A request's ``"lmcache.staleness_probes"``: 0 (not a probe), or the probes after which a
    measured segment gets its staleness prior. An invalid value is logged as a WARNING naming the
    request, and the request is served as no probe."""
    if not isinstance(params, dict) or STALENESS_PROBES not in params:
        return 0
    try:
        return int(REQUEST[STALENESS_PROBES].value(params[STALENESS_PROBES], "kv_transfer_params"))
    except ConfigError as exc:
        logger.warning("request %s: ignoring %s", shorten(str(request_id)), exc)
        return 0


def _request_flag(params: dict, key: str, request_id: str) -> bool:
    """The request-only boolean ``key`` of ``params``; its default when absent, or (logged as a
    WARNING naming the request) when invalid."""
    setting = REQUEST[key]
    if key not in params:
        return setting.default
    try:
        return bool(setting.value(params[key], "kv_transfer_params"))
    except ConfigError as exc:
        logger.warning("request %s: ignoring %s", shorten(str(request_id)), exc)
        return setting.default
