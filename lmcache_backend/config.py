"""CacheBlend configuration, LMCache-compatible.

Every key has a type, a default, an environment variable ``LMCACHE_<KEY>`` and a one-line
description (:data:`CONFIG_KEYS`). Sources, later ones overriding earlier ones:

1. the defaults below;
2. a YAML file named by ``LMCACHE_CONFIG_FILE`` (or the ``config_file`` argument);
3. environment variables ``LMCACHE_<KEY>``;
4. keyword arguments to :func:`load_config` (e.g. vLLM's ``kv_connector_extra_config``).

Values are parsed once and validated; an error names the key, where it came from and the value.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
BACKEND_CHOICES = ("auto", "torch", "cpu", "cuda", "ascend")
# Token selectors (lmcache_backend.blend.selection.SCORERS); kv_deviation is LMCache's.
SELECTION_CHOICES = (
    "kv_deviation",
    "kv_deviation_v",
    "query_attention",
    "query_kv_deviation",
    "query_preview",
    "query_preview_last",
)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the value."""


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true/false/1/0")


def _split_list(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    text = str(value).strip().strip("[]")
    return [part.strip() for part in text.split(",") if part.strip()]


def _parse_float_list(value: Any) -> list[float]:
    if value is None:
        return []
    return [float(v) for v in _split_list(value)]


def _parse_int_list(value: Any) -> list[int]:
    if value is None:
        return []
    out = []
    for v in _split_list(value):
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(f"{v} is not an integer")
        out.append(int(v))
    return out


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("expected an integer")
    return int(value)


def _parse_optional_str(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return None if text.strip().lower() in ("", "none", "null") else text


def _parse_dict(value: Any) -> dict:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    parsed = json.loads(str(value))
    if not isinstance(parsed, dict):
        raise ValueError("expected a JSON object")
    return parsed


@dataclass(frozen=True)
class ConfigKey:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    description: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


CONFIG_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey("enable_blending", _parse_bool, False, "master switch for CacheBlend"),
    ConfigKey(
        "blend_special_str",
        str,
        " # # ",
        'separator string between segments; "" finds chunks without one (blend_block_size)',
    ),
    ConfigKey(
        "blend_segmentation",
        str,
        "auto",
        "how prompts are cut into cached units: auto (around blend_special_str when the prompt "
        "holds it, else in blocks), separator (LMCache's: the separator only) or blocks",
    ),
    ConfigKey(
        "blend_block_size",
        _parse_int,
        16,
        "tokens per block of separator-free reuse (blend_segmentation auto or blocks)",
    ),
    ConfigKey(
        "blend_recompute_ratios",
        _parse_float_list,
        [0.2],
        "fraction of reusable tokens recomputed; one value, or one per check layer",
    ),
    ConfigKey("blend_check_layers", _parse_int_list, [1], "layers where tokens are selected"),
    ConfigKey(
        "blend_selection",
        str,
        "query_preview_last",
        "how check layers choose tokens: " + ", ".join(SELECTION_CHOICES),
    ),
    ConfigKey(
        "blend_position_discount",
        float,
        10.0,
        "preview selections: a token's score is divided by 1 + d * position / prompt length",
    ),
    ConfigKey(
        "blend_selection_span",
        _parse_int,
        1,
        "preview selections choose aligned spans of this many consecutive tokens (1: tokens)",
    ),
    ConfigKey("blend_min_tokens", _parse_int, 256, "fewer reusable tokens -> full prefill"),
    ConfigKey(
        "blend_max_cost",
        float,
        0.6,
        "a prompt whose predicted blend costs more than this share of a full prefill's "
        "token-layers is left to the engine (1: blend whenever anything is reused)",
    ),
    ConfigKey("backend", str, "auto", "op backend: auto, torch, cpu, cuda or ascend"),
    ConfigKey("use_layerwise", _parse_bool, True, "LMCache key; blending is always layerwise"),
    ConfigKey("local_cpu", _parse_bool, True, "keep segments in CPU memory"),
    ConfigKey("max_local_cpu_size", float, 5.0, "CPU segment store capacity in GB"),
    ConfigKey("local_disk", _parse_optional_str, None, "folder for the disk tier (None: off)"),
    ConfigKey("max_local_disk_size", float, 0.0, "disk tier capacity in GB"),
    ConfigKey("remote_url", _parse_optional_str, None, "shared tier, e.g. redis://host:6379"),
    ConfigKey("extra_config", _parse_dict, {}, "LMCache's free-form extra settings (JSON)"),
)
_KEYS_BY_NAME = {key.name: key for key in CONFIG_KEYS}

# LMCache keys this package accepts and does not use, so an LMCache configuration loads without
# warnings. Anything else unknown gets a warning naming the closest known key.
LMCACHE_KEYS_IGNORED = frozenset(
    {
        "chunk_size",
        "save_decode_cache",
        "remote_serde",
        "pre_caching_hash_algorithm",
        "save_unfull_chunk",
        "blocking_timeout_secs",
        "enable_p2p",
        "lookup_url",
        "distributed_url",
        "enable_controller",
        "lmcache_instance_id",
        "controller_url",
        "lmcache_worker_port",
        "use_mla",
        "cufile_buffer_size",
        "log_level",
        "config_file",
        "enable_async_loading",
        "internal_api_server_enabled",
        # read by lmcache_backend.integration.lmcache: run outside the version matrix
        "backend_force_lmcache",
    }
)


@dataclass(frozen=True)
class BlendConfig:
    """Validated CacheBlend settings. Build with :func:`load_config`."""

    enable_blending: bool = False
    blend_special_str: str = " # # "
    # Stock RAG prompts (LangChain, LlamaIndex) hold no separator: auto finds their chunks in
    # blocks and keeps whole-chunk reuse for prompts that mark chunks (docs/frameworks.md).
    blend_segmentation: str = "auto"
    blend_block_size: int = 16
    # Defaults: the best measured trade-off within 25% of token-layers (docs/quality.md).
    # LMCache's behaviour: blend_selection=kv_deviation with LMCache's ratios and check layers.
    blend_recompute_ratios: list[float] = field(default_factory=lambda: [0.2])
    blend_check_layers: list[int] = field(default_factory=lambda: [1])
    blend_selection: str = "query_preview_last"
    # Late tokens cost more to recompute (attention over more keys) and, measured, help less
    # than their preview score says (docs/quality.md, "Position discount").
    blend_position_discount: float = 10.0
    # Consecutive selected tokens are cheaper to attend for (one run of queries reads the keys
    # once): docs/measurements/spans.md.
    blend_selection_span: int = 1
    blend_min_tokens: int = 256
    # Measured blends cost about their token-layer share of a full prefill plus a few percent
    # (lookup, load, write-back): 0.6 keeps every claimed request well below 1x (blend/pays.py).
    blend_max_cost: float = 0.6
    backend: str = "auto"
    use_layerwise: bool = True
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    remote_url: str | None = None
    # repr=False: it may hold a shared secret (shown redacted by describe())
    extra_config: dict = field(default_factory=dict, repr=False)
    # key -> where its value came from ("default", a file path, "LMCACHE_X", "argument")
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _where(self, key: str) -> str:
        return self.sources.get(key, "argument")

    def _fail(self, key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{key} (from {self._where(key)}) = {value!r}: {why}")

    def _validate(self) -> None:
        ratios, layers = self.blend_recompute_ratios, self.blend_check_layers
        if not layers:
            raise self._fail("blend_check_layers", layers, "at least one check layer is needed")
        if any(layer < 0 for layer in layers):
            raise self._fail("blend_check_layers", layers, "layers must be >= 0")
        if sorted(set(layers)) != list(layers):
            raise self._fail("blend_check_layers", layers, "layers must be strictly increasing")
        if not ratios:
            raise self._fail("blend_recompute_ratios", ratios, "at least one ratio is needed")
        for ratio in ratios:
            if not 0.0 <= ratio <= 1.0:  # also refuses NaN
                raise self._fail(
                    "blend_recompute_ratios",
                    ratios,
                    f"ratio {ratio} is outside [0, 1] (0 = naive reuse, 1 = recompute all)",
                )
        if len(ratios) not in (1, len(layers)):
            raise self._fail(
                "blend_recompute_ratios",
                ratios,
                f"give one ratio or one per check layer ({len(layers)} check layers: {layers})",
            )
        if self.blend_selection not in SELECTION_CHOICES:
            raise self._fail(
                "blend_selection",
                self.blend_selection,
                f"choose one of {', '.join(SELECTION_CHOICES)}",
            )
        if not (math.isfinite(self.blend_position_discount) and self.blend_position_discount >= 0):
            raise self._fail(
                "blend_position_discount",
                self.blend_position_discount,
                "must be a finite number >= 0 (0: every position scored alike)",
            )
        if self.blend_selection_span < 1:
            raise self._fail(
                "blend_selection_span",
                self.blend_selection_span,
                "must be >= 1 (tokens per span; 1 chooses single tokens)",
            )
        if self.blend_min_tokens < 0:
            raise self._fail("blend_min_tokens", self.blend_min_tokens, "must be >= 0")
        if not (math.isfinite(self.blend_max_cost) and self.blend_max_cost > 0):
            raise self._fail(
                "blend_max_cost", self.blend_max_cost, "must be a finite number > 0 (a share)"
            )
        if self.blend_segmentation not in ("auto", "separator", "blocks"):
            raise self._fail(
                "blend_segmentation",
                self.blend_segmentation,
                "choose one of auto, separator, blocks",
            )
        if self.blend_block_size < 1:
            raise self._fail("blend_block_size", self.blend_block_size, "must be >= 1 (tokens)")
        if self.backend not in BACKEND_CHOICES:
            raise self._fail("backend", self.backend, f"choose one of {', '.join(BACKEND_CHOICES)}")
        # "not >": NaN compares false with everything and would pass a "<= 0" check
        if not (math.isfinite(self.max_local_cpu_size) and self.max_local_cpu_size > 0):
            raise self._fail(
                "max_local_cpu_size", self.max_local_cpu_size, "must be a finite number > 0 (GB)"
            )
        if not (math.isfinite(self.max_local_disk_size) and self.max_local_disk_size >= 0):
            raise self._fail(
                "max_local_disk_size", self.max_local_disk_size, "must be a finite number >= 0 (GB)"
            )
        if not self.use_layerwise and self.enable_blending:
            logger.info("use_layerwise=False is ignored: CacheBlend always runs layer by layer")

    def check_schedule(self) -> list[tuple[int, float]]:
        """``[(check_layer, ratio), ...]`` with one ratio broadcast to every check layer.

        Each ratio is a fraction of all reusable tokens of the prompt; a later check layer
        selects among the tokens the earlier ones kept.
        """
        ratios = self.blend_recompute_ratios
        if len(ratios) == 1:
            ratios = ratios * len(self.blend_check_layers)
        return list(zip(self.blend_check_layers, ratios))

    def validate_for_model(self, num_layers: int) -> None:
        """Raise :class:`ConfigError` if a check layer is beyond a model of ``num_layers``."""
        for layer in self.blend_check_layers:
            if layer >= num_layers:
                raise self._fail(
                    "blend_check_layers",
                    self.blend_check_layers,
                    f"layer {layer} does not exist: the model has {num_layers} layers "
                    f"(0..{num_layers - 1})",
                )

    def replace(self, **changes: Any) -> BlendConfig:
        """A copy with ``changes`` applied (parsed and validated like keyword arguments)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}
        sources = dict(self.sources)
        for key, raw in changes.items():
            values[key] = _parse_value(key, raw, "argument")
            sources[key] = "argument"
        return BlendConfig(**values, sources=sources)

    def describe(self) -> str:
        """One line per key: ``name = value  (source)``; secrets are shown as ``<hidden>``."""
        return "\n".join(
            f"{key.name} = {_redacted(key.name, getattr(self, key.name))!r}  "
            f"({self.sources.get(key.name, 'default')})"
            for key in CONFIG_KEYS
        )


#: ``extra_config`` keys whose values are never printed
SECRET_EXTRA_KEYS = frozenset({"shared_secret"})


def _redacted(key: str, value: Any) -> Any:
    """``value`` of ``key`` fit to print: ``extra_config``'s secrets replaced."""
    if key == "extra_config" and isinstance(value, Mapping):
        return {k: "<hidden>" if k in SECRET_EXTRA_KEYS else v for k, v in value.items()}
    if key == "extra_config" and any(s in str(value) for s in SECRET_EXTRA_KEYS):
        return "<hidden: holds a secret>"
    return value


def _parse_value(key: str, raw: Any, where: str) -> Any:
    spec = _KEYS_BY_NAME[key]
    try:
        return spec.parse(raw)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        shown = _redacted(key, raw)
        raise ConfigError(f"{key} (from {where}) = {shown!r}: cannot parse ({exc})") from None


def _warn_unknown(key: str, where: str) -> None:
    if key in LMCACHE_KEYS_IGNORED:
        logger.debug("LMCache setting %s (from %s) is not used by lmcache_backend", key, where)
        return
    close = difflib.get_close_matches(key, list(_KEYS_BY_NAME), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    logger.warning("unknown configuration key %r (from %s) ignored%s", key, where, hint)


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{CONFIG_FILE_ENV}: file {path!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path!r} must hold a mapping of keys to values")
    return data


def load_config(
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> BlendConfig:
    """Build the configuration from defaults, YAML file, environment and ``overrides``.

    Args:
        config_file: YAML path; defaults to ``$LMCACHE_CONFIG_FILE``.
        env: environment mapping (defaults to ``os.environ``).
        overrides: key=value pairs; highest precedence. ``None`` values are skipped.

    Raises:
        ConfigError: a value cannot be parsed or fails validation (the message names the key,
            where the value came from and the value).
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(key: str, raw: Any, where: str) -> None:
        if key not in _KEYS_BY_NAME:
            _warn_unknown(key, where)
            return
        values[key] = _parse_value(key, raw, where)
        sources[key] = where

    path = config_file or env.get(CONFIG_FILE_ENV)
    if path:
        for key, raw in _read_yaml(path).items():
            take(str(key), raw, path)
    for name, raw in env.items():
        if name.startswith(ENV_PREFIX) and name != CONFIG_FILE_ENV:
            take(name[len(ENV_PREFIX) :].lower(), raw, name)
    for key, raw in overrides.items():
        if raw is not None:
            take(key, raw, "argument")
    return BlendConfig(**values, sources=sources)
