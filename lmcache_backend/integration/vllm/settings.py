"""The connector's settings, read the LMCache way, shared by its scheduler and worker sides.

Sources: ``LMCACHE_CONFIG_FILE`` / ``LMCACHE_*`` environment variables, then vLLM's
``kv_connector_extra_config`` on top. Per request, ``kv_transfer_params`` may carry
``{"blend": false}`` (no reuse for this request), ``{"blend_recompute_ratios": [...]}``,
``{"blend_check_layers": [...]}`` or ``{"blend_selection": "..."}``. A malformed per-request value
never fails the engine: it is logged (WARNING, naming the request, key and value) and the engine's
settings apply.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from lmcache_backend.blend.patterns import SegmentPattern, segment_pattern
from lmcache_backend.config import BlendConfig, ConfigError, load_config
from lmcache_backend.storage.index_dir import default_index_dir
from lmcache_backend.storage.settings import store_settings

logger = logging.getLogger(__name__)

#: ``kv_connector_extra_config`` keys that belong to vLLM's side, not to :class:`BlendConfig`.
CONNECTOR_KEYS = (
    "instance_id",
    "stats_file",
    "allow_untested_versions",
    "verify_on_start",
    "profile",
    "blend_layers_per_step",
    "engine_forward",
    "selected_attention",
)

#: layer passes per engine step of a sliced blend with ``blend_layers_per_step="auto"``
AUTO_LAYERS_PER_STEP = 8
#: vLLM's step budget in tokens where its scheduler config does not say
DEFAULT_STEP_TOKENS = 8192

#: ``selected_attention`` values: the kernel of the selected tokens' attention in vLLM's forward
SELECTED_ATTENTION = ("auto", "tiled", "vllm")

#: ``kv_transfer_params`` keys a request may set.
REQUEST_KEYS = ("blend", "blend_recompute_ratios", "blend_check_layers", "blend_selection")


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything both connector sides derive from the engine's configuration.

    Attributes:
        config: the validated blend configuration.
        instance_id: names this engine's cross-process segment index (scheduler and workers).
        tp_size: tensor-parallel ranks; each keeps its own store shard and index.
        separator: how prompts split into cached units, derived from the model's tokenizer
            at start-up: ``blend_special_str`` as the ids it produces inside text, or, when it
            is empty, blocks of ``blend_block_size`` tokens found at any offset.
        stats_file: optional JSON-lines file receiving one record per blended request.
        allow_untested_versions: run a vLLM / vllm-ascend release the version gate has no
            record of with the nearest code path (:mod:`lmcache_backend.compat.gate`).
        verify_on_start: run ``lmcache-backend verify``'s model checks once when the worker is
            ready and log the result (see :mod:`lmcache_backend.commands.verify`).
        num_layers: the model's decoder layers (a request's check layers must exist).
        profile: time the phases of each blended request (``BlendRecord.profile``).
        blend_layers_per_step: 0: a claimed prompt is blended at once, before the forward
            pass of the step that computes its question tail. ``n > 0``: prompts whose
            selection never computes a token of the tail in a blend layer (the preview
            selections) are loaded asynchronously, ``n`` layer passes per engine step (preview
            layers count), so the other requests keep decoding between the slices; the
            check-layer selections stay synchronous. A fixed number of passes, never a time
            budget: tensor-parallel ranks run the same collectives in the same order.
            ``"auto"`` (the default): :data:`AUTO_LAYERS_PER_STEP` passes a step for claims of
            at least ``slice_from_tokens`` tokens, at once for shorter ones.
        slice_from_tokens: the shortest claim that is sliced: 0 with a number of layers per
            step (every claim), vLLM's ``max_num_batched_tokens`` with ``"auto"``: a blend
            longer than one of vLLM's own prefill steps is sliced, a shorter one (which stalls
            the other requests less than a prefill of the same prompt would) runs at once,
            where slicing would cost it a fifth to a third more time to first token.
        slicing_auto: ``blend_layers_per_step`` was ``"auto"`` (the connector turns it to 0,
            with a log line, where vLLM's asynchronous loads are not verified).
        engine_forward: True (default): once a preview selection is fixed, a synchronous
            load runs the selected tokens through vLLM's own compiled forward pass over the
            blended paged cache (vLLM's CPU attention backend); False: through the blender's
            layer-by-layer path (also used for sliced loads and the check-layer selections).
        selected_attention: the attention kernel of that pass. ``"auto"`` (default): the
            blend's tiled kernel where it builds and runs (x86-64 with AVX-512 BF16, a bf16
            model), else vLLM's, logged; ``"tiled"``: the tiled kernel or an error at start;
            ``"vllm"``: vLLM's CPU attention (one request per run of selected positions). On
            CUDA/Ascend: ``"tiled"`` (and ``"auto"`` on CUDA) attends over a layer's contiguous
            rows where the blend holds them (check-layer selections), else through the block
            table; ``"vllm"`` (and ``"auto"`` on Ascend) always through the block table.
    """

    config: BlendConfig
    instance_id: str
    tp_size: int
    separator: SegmentPattern
    stats_file: str | None
    allow_untested_versions: bool
    verify_on_start: bool = False
    num_layers: int | None = None
    profile: bool = False
    blend_layers_per_step: int = 0
    slice_from_tokens: int = 0
    slicing_auto: bool = False
    engine_forward: bool = True
    selected_attention: str = "auto"

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


def load_settings(vllm_config: Any) -> ConnectorSettings:
    """Read and validate the settings of the engine described by ``vllm_config``.

    Raises:
        ConfigError: a setting is invalid (the message names the key and value), or it does not
            fit the model (e.g. a check layer beyond the last layer).
    """
    kv = vllm_config.kv_transfer_config
    extra = dict(getattr(kv, "kv_connector_extra_config", None) or {})
    own = {k: extra.pop(k) for k in CONNECTOR_KEYS if k in extra}
    config = load_config(**extra)
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
    tokenizer = _tokenizer(
        str(mc.tokenizer), getattr(mc, "tokenizer_revision", None), bool(mc.trust_remote_code)
    )
    try:
        separator = segment_pattern(
            tokenizer,
            config.blend_special_str,
            config.blend_block_size,
            config.blend_segmentation,
        )
    except ValueError as exc:
        raise ConfigError(f"blend_special_str={config.blend_special_str!r}: {exc}") from exc
    instance_id = str(own.get("instance_id") or f"vllm-{kv.engine_id}")
    try:  # it names the index folder: a plain name, checked now rather than in the worker
        default_index_dir(instance_id)
    except ValueError as exc:
        raise ConfigError(f"instance_id={own.get('instance_id')!r}: {exc}") from None
    store_settings(config)  # the store's extra_config keys (and the secret file), at start
    return ConnectorSettings(
        config=config,
        instance_id=instance_id,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        separator=separator,
        stats_file=own.get("stats_file"),
        allow_untested_versions=_flag(
            "allow_untested_versions", own.get("allow_untested_versions", False)
        ),
        verify_on_start=_flag("verify_on_start", own.get("verify_on_start", False)),
        num_layers=num_layers,
        profile=_flag("profile", own.get("profile", False)),
        **_slicing(own.get("blend_layers_per_step", "auto"), vllm_config),
        engine_forward=_flag("engine_forward", own.get("engine_forward", True)),
        selected_attention=_choice(
            "selected_attention", own.get("selected_attention", "auto"), SELECTED_ATTENTION
        ),
    )


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """A connector key taking one of ``choices`` (case and surrounding spaces ignored)."""
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ConfigError(f"{key}={value!r}: expected one of {', '.join(choices)}")


def _slicing(value: Any, vllm_config: Any) -> dict[str, Any]:
    """``blend_layers_per_step`` (a count, or ``"auto"``) as the settings' slicing fields."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        scheduler = getattr(vllm_config, "scheduler_config", None)
        step_tokens = getattr(scheduler, "max_num_batched_tokens", None) or DEFAULT_STEP_TOKENS
        return {
            "blend_layers_per_step": AUTO_LAYERS_PER_STEP,
            "slice_from_tokens": int(step_tokens),
            "slicing_auto": True,
        }
    try:
        layers = _count("blend_layers_per_step", value)
    except ConfigError:
        raise ConfigError(
            f"blend_layers_per_step={value!r}: expected an integer >= 0 or 'auto'"
        ) from None
    return {"blend_layers_per_step": layers, "slice_from_tokens": 0, "slicing_auto": False}


def _count(key: str, value: Any) -> int:
    """A non-negative integer connector key (an int, or a string of digits)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(f"{key}={value!r}: expected an integer >= 0")


def _flag(key: str, value: Any) -> bool:
    """A boolean connector key: a bool or one of true/false, yes/no, on/off, 1/0."""
    words = {"1": True, "true": True, "yes": True, "on": True}
    words.update({"0": False, "false": False, "no": False, "off": False})
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in words:
        return words[value.strip().lower()]
    raise ConfigError(f"{key}={value!r}: expected true or false")


def request_config(
    config: BlendConfig,
    params: Any,
    num_layers: int | None = None,
    request_id: str = "?",
) -> BlendConfig | None:
    """The configuration of one request after its ``kv_transfer_params``; None: do not blend.

    ``params`` comes from the client unchecked (any JSON value). ``{"blend": false}`` opts out;
    ``blend_recompute_ratios`` / ``blend_check_layers`` / ``blend_selection`` are parsed like
    the engine's settings and the check layers must exist in a model of ``num_layers``.
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
            "request %s: ignoring kv_transfer_params %r: expected a JSON object", request_id, params
        )
        return config
    unknown = sorted(k for k in params if str(k).startswith("blend") and k not in REQUEST_KEYS)
    if unknown:
        logger.warning(
            "request %s: ignoring unknown kv_transfer_params %s (known: %s)",
            request_id,
            unknown,
            ", ".join(REQUEST_KEYS),
        )
    blend = params.get("blend", True)
    if blend is False:
        return None
    if blend is not True:
        logger.warning(
            "request %s: ignoring kv_transfer_params blend=%r: expected true or false",
            request_id,
            blend,
        )
    changes = {k: params[k] for k in REQUEST_KEYS[1:] if k in params}
    if not changes:
        return config
    try:
        out = config.replace(**changes)
        if num_layers is not None:
            out.validate_for_model(num_layers)
        return out
    except (ConfigError, TypeError, ValueError) as exc:
        logger.warning(
            "request %s: ignoring kv_transfer_params %s: %s; the engine's settings apply",
            request_id,
            changes,
            exc,
        )
        return config
