"""CacheBlend configuration, LMCache-compatible: :class:`BlendConfig` and :func:`load_config`.

``BlendConfig`` has one field per engine key of the settings registry
(:mod:`lmcache_backend.settings.engine_keys`: name, parser, default, description, the
``LMCACHE_<KEY>`` variable). Sources, later ones overriding earlier ones
(:mod:`lmcache_backend.settings.sources`):

1. the registry's defaults;
2. a YAML file named by ``LMCACHE_CONFIG_FILE`` (or the ``config_file`` argument);
3. environment variables ``LMCACHE_<KEY>``;
4. keyword arguments to :func:`load_config` (e.g. vLLM's ``kv_connector_extra_config``).

Values are parsed once and checked; an error names the key, where it came from, the value and
what is accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import field, fields, make_dataclass
from typing import Any

from lmcache_backend.settings import (  # noqa: F401 - public names, re-exported
    BACKEND_CHOICES,
    CONFIG_FILE_ENV,
    ENGINE,
    ENV_PREFIX,
    LMCACHE_KEYS_IGNORED,
    PREVIEW_SELECTION_CHOICES,
    SCORED_LAYER_CHOICES,
    SELECTION_CHOICES,
    ConfigError,
    Setting,
    dataclass_fields,
)
from lmcache_backend.settings.sources import ARGUMENT, engine_values

logger = logging.getLogger(__name__)

#: the engine keys, in the registry's order (``name``, ``env``, ``description``, ...)
CONFIG_KEYS: tuple[Setting, ...] = tuple(ENGINE.values())


class _BlendConfigMethods:
    """What :class:`BlendConfig` does besides holding the engine keys' values."""

    def __post_init__(self) -> None:
        # every value is checked by its key's parser (a parsed value parses to itself), so a
        # BlendConfig built directly is held to the same rules as a loaded one
        for name, setting in ENGINE.items():
            object.__setattr__(self, name, setting.value(getattr(self, name), self._where(name)))
        self._check_together()

    def _where(self, key: str) -> str:
        return self.sources.get(key, ARGUMENT)

    def _fail(self, key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{key} (from {self._where(key)}) = {value!r}: {why}")

    def _check_together(self) -> None:
        """The rules between keys (each key's own range is its parser's)."""
        ratios, layers = self.blend_recompute_ratios, self.blend_check_layers
        if len(ratios) not in (1, len(layers)):
            raise self._fail(
                "blend_recompute_ratios",
                ratios,
                f"give one ratio or one per check layer ({len(layers)} check layers: {layers})",
            )
        for knob in ("blend_min_read_share", "blend_max_divergence"):
            value = getattr(self, knob)
            if value > 0 and self.blend_selection not in PREVIEW_SELECTION_CHOICES:
                raise self._fail(
                    knob,
                    value,
                    f"needs a preview selection ({', '.join(PREVIEW_SELECTION_CHOICES)}), and "
                    f"blend_selection is {self.blend_selection!r}",
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

    def final_ratio(self) -> float:
        """The ratio of the last check layer: the share of the reusable tokens recomputed in
        the layers after the selection, and the whole budget of the selections that choose
        once (the preview selections)."""
        return self.check_schedule()[-1][1]

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
        """A copy with ``changes`` applied (parsed and checked like keyword arguments)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}
        sources = dict(self.sources)
        for key, raw in changes.items():
            if key not in ENGINE:
                raise TypeError(f"{key!r} is not a configuration key")
            values[key] = ENGINE[key].value(raw, ARGUMENT)
            sources[key] = ARGUMENT
        return BlendConfig(**values, sources=sources)

    def describe(self) -> str:
        """One line per key: ``name = value  (source)``; secrets are shown as ``<hidden>``."""
        return "\n".join(
            f"{name} = {setting.printable(getattr(self, name))!r}  "
            f"({self.sources.get(name, 'default')})"
            for name, setting in ENGINE.items()
        )


BlendConfig = make_dataclass(
    "BlendConfig",
    [
        *dataclass_fields(ENGINE),
        # key -> where its value came from ("default", a file path, "LMCACHE_X", "argument")
        ("sources", dict, field(default_factory=dict, compare=False, repr=False)),
    ],
    bases=(_BlendConfigMethods,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "Validated CacheBlend settings, one field per engine key (README's "
        "configuration table). Build with :func:`load_config`.",
    },
)


def load_config(
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> BlendConfig:
    """Build the configuration from defaults, YAML file, environment and ``overrides``.

    Args:
        config_file: YAML path; defaults to ``$LMCACHE_CONFIG_FILE``.
        env: environment mapping (defaults to the process environment).
        overrides: key=value pairs; highest precedence. ``None`` values are skipped. Keys of
            the vLLM connector (``kv_connector_extra_config`` holds both) are left to it.

    Raises:
        ConfigError: a value cannot be parsed or fails validation (the message names the key,
            where the value came from and the value).
    """
    values, sources = engine_values(config_file, env, overrides)
    return BlendConfig(**values, sources=sources)
