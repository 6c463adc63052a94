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
what is accepted. The fields of :class:`BlendConfig` are generated from the registry
(:mod:`lmcache_backend.settings.codegen`): after adding a key, ``lmcache-backend config --docs``
writes its field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields
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
    setting_field,
)
from lmcache_backend.settings.sources import ARGUMENT, engine_values

logger = logging.getLogger(__name__)

#: the engine keys, in the registry's order (``name``, ``env``, ``description``, ...)
CONFIG_KEYS: tuple[Setting, ...] = tuple(ENGINE.values())


@dataclass(frozen=True)
class BlendConfig:
    """Validated CacheBlend settings, one field per engine key (README's configuration table).
    Build with :func:`load_config`; built directly, each value is checked by its key's parser.
    """

    # <settings-fields: dataclass engine>
    #: master switch for CacheBlend
    enable_blending: bool = setting_field(ENGINE["enable_blending"])
    #: separator string between segments
    blend_special_str: str = setting_field(ENGINE["blend_special_str"])
    #: how prompts are cut into cached units
    blend_segmentation: str = setting_field(ENGINE["blend_segmentation"])
    #: tokens per block of separator-free reuse
    blend_block_size: int = setting_field(ENGINE["blend_block_size"])
    #: share of the reusable tokens recomputed: one value, or one per check layer
    blend_recompute_ratios: list[float] = setting_field(ENGINE["blend_recompute_ratios"])
    #: layers where the check-layer selections choose tokens
    blend_check_layers: list[int] = setting_field(ENGINE["blend_check_layers"])
    #: how the recomputed tokens are chosen
    blend_selection: str = setting_field(ENGINE["blend_selection"])
    #: preview selections recompute more tokens, up to `blend_max_recompute_ratio`, until the
    #: recomputed ones hold this share of what the question reads of the reused text
    blend_min_read_share: float = setting_field(ENGINE["blend_min_read_share"])
    #: the largest share of the reusable tokens that `blend_min_read_share` and
    #: `blend_max_divergence` may recompute
    blend_max_recompute_ratio: float = setting_field(ENGINE["blend_max_recompute_ratio"])
    #: preview selections recompute more tokens, up to `blend_max_recompute_ratio`, until the
    #: blend's divergence estimate is at most this
    blend_max_divergence: float = setting_field(ENGINE["blend_max_divergence"])
    #: preview selections divide a token's score by 1 + d * position / prompt length
    blend_position_discount: float = setting_field(ENGINE["blend_position_discount"])
    #: preview selections recompute aligned spans of this many consecutive tokens
    blend_selection_span: int = setting_field(ENGINE["blend_selection_span"])
    #: preview selections recompute the first this many tokens of every reused chunk first
    blend_chunk_head_tokens: int = setting_field(ENGINE["blend_chunk_head_tokens"])
    #: preview selections score the reads of the layers from this share of the depth on
    blend_preview_scored_from: float = setting_field(ENGINE["blend_preview_scored_from"])
    #: which layers' reads the preview selections score
    blend_preview_scored_layers: str = setting_field(ENGINE["blend_preview_scored_layers"])
    #: fewer reusable tokens than this: the prompt is prefilled as usual (logged)
    blend_min_tokens: int = setting_field(ENGINE["blend_min_tokens"])
    #: a prompt whose predicted blend costs more than this share of a full prefill's token-layers is
    #: prefilled as usual
    blend_max_cost: float = setting_field(ENGINE["blend_max_cost"])
    #: op backend
    backend: str = setting_field(ENGINE["backend"])
    #: LMCache's key; CacheBlend always runs layer by layer (false is logged and ignored)
    use_layerwise: bool = setting_field(ENGINE["use_layerwise"])
    #: keep segments in CPU memory
    local_cpu: bool = setting_field(ENGINE["local_cpu"])
    #: CPU tier capacity, GB (2^30 bytes)
    max_local_cpu_size: float = setting_field(ENGINE["max_local_cpu_size"])
    #: folder of the disk tier (one safetensors file per segment); `file:///path` works
    local_disk: str | None = setting_field(ENGINE["local_disk"])
    #: disk tier capacity, GB; the disk tier is on only when this is > 0
    max_local_disk_size: float = setting_field(ENGINE["max_local_disk_size"])
    #: shared Redis tier: one server, a Redis Cluster or Sentinel
    remote_url: str | None = setting_field(ENGINE["remote_url"])
    #: further settings (a JSON object): the store's keys below, LMCache's own
    extra_config: dict[str, Any] = setting_field(ENGINE["extra_config"])
    # </settings-fields>
    #: key -> where its value came from ("default", a file path, "LMCACHE_X", "argument")
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    #: the values are their parsers' results already (:func:`load_config`, :meth:`replace`):
    #: only the rules between keys are checked
    _parsed: InitVar[bool] = False

    def __post_init__(self, _parsed: bool) -> None:
        if not _parsed:
            # every value is checked by its key's parser (a parsed value parses to itself), so
            # a BlendConfig built directly is held to the same rules as a loaded one
            for name, setting in ENGINE.items():
                value = setting.value(getattr(self, name), self._where(name))
                object.__setattr__(self, name, value)
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
        """Raise :class:`ConfigError` if a check layer is beyond a model of ``num_layers``.

        Checked once per configuration and model: the engine, the connector and the blender
        each ask (whichever builds first reports the error), the later ones are answered by the
        first check.
        """
        if self.__dict__.get("_fits_layers") == num_layers:
            return
        self._check_layers(num_layers)
        object.__setattr__(self, "_fits_layers", num_layers)

    def _check_layers(self, num_layers: int) -> None:
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
        for key in changes:
            if key not in ENGINE:
                raise TypeError(f"{key!r} is not a configuration key")
        parsed = {key: ENGINE[key].value(raw, ARGUMENT) for key, raw in changes.items()}
        return self.replace_parsed(parsed)

    def replace_parsed(self, values: Mapping[str, Any]) -> BlendConfig:
        """A copy with ``values`` applied that are their keys' parsers' results already (e.g.
        from :func:`~lmcache_backend.settings.parse_given`): only the rules between keys are
        checked again."""
        merged = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}
        merged.update(values)
        sources = {**self.sources, **dict.fromkeys(values, ARGUMENT)}
        return BlendConfig(**merged, sources=sources, _parsed=True)

    def describe(self) -> str:
        """One line per key: ``name = value  (source)``; secrets are shown as ``<hidden>``."""
        return "\n".join(
            f"{name} = {setting.printable(getattr(self, name))!r}  "
            f"({self.sources.get(name, 'default')})"
            for name, setting in ENGINE.items()
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
    return BlendConfig(**values, sources=sources, _parsed=True)
