"""The configuration keys: name, parser, default, ``LMCACHE_<KEY>`` variable, description; and
the LMCache keys accepted and not used. :mod:`lmcache_backend.config` loads and validates them."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
BACKEND_CHOICES = ("auto", "torch", "cpu", "cuda", "ascend")
#: ``blend_preview_scored_layers`` values
SCORED_LAYER_CHOICES = ("global", "all")
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
    ConfigKey(
        "blend_chunk_head_tokens",
        _parse_int,
        0,
        "preview selections recompute the first this many tokens of every reused chunk first",
    ),
    ConfigKey(
        "blend_preview_scored_from",
        float,
        0.0,
        "preview selections score the reads of layers from this share of the depth on",
    ),
    ConfigKey(
        "blend_preview_scored_layers",
        str,
        "global",
        "preview selections score the reads of: global (the layers that see the whole "
        "prompt, every layer where none does) or all",
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
