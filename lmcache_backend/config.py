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
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from lmcache_backend.config_keys import (  # noqa: F401 - public names, re-exported
    _KEYS_BY_NAME,
    BACKEND_CHOICES,
    CONFIG_FILE_ENV,
    CONFIG_KEYS,
    ENV_PREFIX,
    LMCACHE_KEYS_IGNORED,
    SCORED_LAYER_CHOICES,
    SELECTION_CHOICES,
    ConfigError,
    ConfigKey,
    _parse_bool,
)

logger = logging.getLogger(__name__)


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
    # Models whose recomputed tokens lean on each chunk's first tokens (Gemma 3) answer closer to
    # full prefill when those are recomputed first; others lose by it (docs/quality.md).
    blend_chunk_head_tokens: int = 0
    # Shallow layers' cached K/V barely drift, so their reads point at tokens whose recompute
    # pays little (docs/quality.md, "Scored layers").
    blend_preview_scored_from: float = 0.0
    # A sliding-window layer shorter than the prompt reads only the prompt's end, whatever the
    # answer needs from the rest (docs/quality.md, "Windowed layers"): "global" scores the
    # layers that see the whole prompt.
    blend_preview_scored_layers: str = "global"
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
        if self.blend_chunk_head_tokens < 0:
            raise self._fail(
                "blend_chunk_head_tokens", self.blend_chunk_head_tokens, "must be >= 0 (tokens)"
            )
        share = self.blend_preview_scored_from
        if not (math.isfinite(share) and 0 <= share < 1):
            raise self._fail(
                "blend_preview_scored_from", share, "must be a share of the layers in [0, 1)"
            )
        if self.blend_preview_scored_layers not in SCORED_LAYER_CHOICES:
            raise self._fail(
                "blend_preview_scored_layers",
                self.blend_preview_scored_layers,
                f"choose one of {', '.join(SCORED_LAYER_CHOICES)}",
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
