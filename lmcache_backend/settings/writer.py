"""The one writer of the variables this package sets: the environment of a process it starts (a
server, an engine child) or of an engine it starts in this process.

Values are given typed, by name: an engine key by its own name (``enable_blending=True``, written
as ``LMCACHE_ENABLE_BLENDING``), an environment-only variable by its name in lower case
(``vllm_cpu_kvcache_space=2``, written as ``VLLM_CPU_KVCACHE_SPACE``). :class:`Variables` declares
every one with its type (generated from the registry), so a type checker refuses a misspelt name
or a wrong type. Each value is checked by its setting's parser first (a bad one raises
:class:`~lmcache_backend.settings.setting.ConfigError` naming the key and the value) and written
as text that parser reads back to the same value; ``None`` unsets the variable.

* :func:`child_env`: a child's environment: this process's, ``defaults`` where it leaves a
  variable unset, then the values given;
* :func:`export`: the same, into this process's environment (for an engine started here, whose
  workers inherit it);
* :data:`STARTED_ENGINE`: what every engine this package starts for a demo, a check or a
  benchmark gets unless the environment says otherwise.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, TypedDict

from lmcache_backend.settings.codegen import key_of
from lmcache_backend.settings.registry import ENGINE, ENVIRONMENT
from lmcache_backend.settings.setting import Setting

if TYPE_CHECKING:
    from typing_extensions import Unpack


class Variables(TypedDict, total=False):
    """What :func:`child_env` and :func:`export` write: every engine key by its name, every
    environment-only variable by its name in lower case (generated from the registry)."""

    # <settings-fields: typeddict engine environment>
    #: master switch for CacheBlend
    enable_blending: bool
    #: separator string between segments
    blend_special_str: str
    #: how prompts are cut into cached units
    blend_segmentation: str
    #: tokens per block of separator-free reuse
    blend_block_size: int
    #: share of the reusable tokens recomputed: one value, or one per check layer
    blend_recompute_ratios: list[float]
    #: layers where the check-layer selections choose tokens
    blend_check_layers: list[int]
    #: how the recomputed tokens are chosen
    blend_selection: str
    #: preview selections recompute more tokens, up to `blend_max_recompute_ratio`, until the
    #: recomputed ones hold this share of what the question reads of the reused text
    blend_min_read_share: float
    #: the largest share of the reusable tokens that `blend_min_read_share` and
    #: `blend_max_divergence` may recompute
    blend_max_recompute_ratio: float
    #: preview selections recompute more tokens, up to `blend_max_recompute_ratio`, until the
    #: blend's divergence estimate is at most this
    blend_max_divergence: float
    #: preview selections divide a token's score by 1 + d * position / prompt length
    blend_position_discount: float
    #: preview selections recompute aligned spans of this many consecutive tokens
    blend_selection_span: int
    #: preview selections recompute the first this many tokens of every reused chunk first
    blend_chunk_head_tokens: int
    #: preview selections score the reads of the layers from this share of the depth on
    blend_preview_scored_from: float
    #: which layers' reads the preview selections score
    blend_preview_scored_layers: str
    #: fewer reusable tokens than this: the prompt is prefilled as usual (logged)
    blend_min_tokens: int
    #: a prompt whose predicted blend costs more than this share of a full prefill's token-layers is
    #: prefilled as usual
    blend_max_cost: float
    #: op backend
    backend: str
    #: LMCache's key; CacheBlend always runs layer by layer (false is logged and ignored)
    use_layerwise: bool
    #: keep segments in CPU memory
    local_cpu: bool
    #: CPU tier capacity, GB (2^30 bytes)
    max_local_cpu_size: float
    #: folder of the disk tier (one safetensors file per segment); `file:///path` works
    local_disk: str | None
    #: disk tier capacity, GB; the disk tier is on only when this is > 0
    max_local_disk_size: float
    #: shared Redis tier: one server, a Redis Cluster or Sentinel
    remote_url: str | None
    #: further settings (a JSON object): the store's keys below, LMCache's own
    extra_config: dict[str, Any]
    #: YAML file of engine keys
    lmcache_config_file: str | None
    #: where the CPU backend builds its tiled attention kernel
    lmcache_kernel_cache: str | None
    #: where the embedded models are converted to safetensors on first use
    lmcache_backend_cache_dir: str | None
    #: hook into an LMCache / vLLM combination outside the version matrix
    lmcache_backend_force_lmcache: bool | None
    #: level of the connector's log lines when the application configured no logging
    vllm_logging_level: str
    #: vLLM's CPU core binding; `lmcache-backend bench --engine vllm` passes it on
    vllm_cpu_omp_threads_bind: str | None
    #: GiB of KV cache vLLM's CPU build allocates
    vllm_cpu_kvcache_space: int | None
    #: vLLM's KV split in its CPU attention; the connector follows vLLM's setting
    vllm_cpu_attn_split_kv: bool | None
    #: lets vLLM send a function to its workers pickled; `verify` and the hardware check set it for
    #: the engines they start, whose workers run the checks' own functions
    vllm_allow_insecure_serialization: bool | None
    #: vLLM's engine core in a process of its own; `python -m
    #: lmcache_backend.bench.profiling.profile --ops` turns it off, so that the profiler sees the
    #: worker
    vllm_enable_v1_multiprocessing: bool | None
    #: vLLM's second model runner; `hardware-check --steps vllm` turns it off (it needs a compiled
    #: op the step's stand-in does not provide)
    vllm_use_v2_model_runner: bool | None
    #: vLLM's FlashInfer sampling kernels; `hardware-check --steps vllm` turns them off (Triton and
    #: torch sample instead)
    vllm_use_flashinfer_sampler: bool | None
    #: stops vLLM's usage report; `hardware-check --steps vllm` sets it on a machine without network
    vllm_no_usage_stats: bool | None
    #: vLLM's attention backend in releases that read the variable; the hardware check sets it for
    #: each backend it verifies
    vllm_attention_backend: str | None
    #: vLLM 0.10's switch to another read of the TRITON_ATTN cache; the connector refuses that cache
    #: at start-up when it is on
    vllm_v1_use_prefill_decode_attention: str | None
    #: the Sentinel master's name when neither the `redis-sentinel://` URL's path nor
    #: `extra_config.remote_sentinel_master` gives it
    redis_service_name: str | None
    #: run the CUDA backend's Triton kernels in Triton's interpreter, on CPU tensors
    triton_interpret: bool | None
    #: threads of torch's CPU kernels; the benchmarks report it
    omp_num_threads: int | None
    #: run the tests marked `real_model` (engines on Gemma 3 270M)
    lmcache_test_real_models: bool | None
    #: leave out the tensor-parallel engine test (`tests/integration/vllm/test_vllm_tp.py`)
    lmcache_backend_skip_tp: bool | None
    #: base of `LMCACHE_BACKEND_CACHE_DIR`'s default
    xdg_cache_home: str | None
    # </settings-fields>


#: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) of the engines this package starts on a CPU: a demo, a
#: check or a benchmark needs a few thousand tokens of KV cache, not vLLM's share of all memory
STARTED_KV_CACHE_GIB = 2
#: defaults of every engine this package starts (the environment's own values win): blending on,
#: a small KV cache on a CPU
STARTED_ENGINE: Variables = {
    "enable_blending": True,
    "vllm_cpu_kvcache_space": STARTED_KV_CACHE_GIB,
}

#: every writable setting by its Python name
_BY_KEY: dict[str, Setting] = {key_of(s): s for s in (*ENGINE.values(), *ENVIRONMENT.values())}


def variable(key: str) -> str:
    """The variable that sets ``key`` (``blend_recompute_ratios`` ->
    ``LMCACHE_BLEND_RECOMPUTE_RATIOS``, ``vllm_cpu_kvcache_space`` -> ``VLLM_CPU_KVCACHE_SPACE``).

    Raises:
        KeyError: ``key`` is neither an engine key nor an environment-only variable.
    """
    env = _BY_KEY[key].env
    assert env is not None  # engine and environment settings have one
    return env


def _text(value: Any) -> str:
    """A parsed value as the text its parser reads back (a boolean as 1 or 0: vLLM reads its own
    boolean variables as integers)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(_text(item) for item in value)
    if isinstance(value, Mapping):
        return json.dumps(dict(value))
    return str(value)


def text(key: str, value: Any) -> str | None:
    """``value`` of ``key`` checked by its parser and written as the text the parser reads back
    to the same value; None for a value that means "not set".

    Raises:
        KeyError: ``key`` is not declared.
        ConfigError: ``value`` does not parse (names the key and the value).
    """
    setting = _BY_KEY[key]
    parsed = setting.value(value, "argument")
    if parsed is None:
        return None
    out = _text(parsed)
    if setting.value(out, variable(key)) != parsed:  # never written in a form read otherwise
        raise setting.error(value, "argument", f"cannot be written as a variable ({out!r})")
    return out


def _texts(values: Mapping[str, Any]) -> dict[str, str | None]:
    return {variable(key): text(key, value) for key, value in values.items()}


def variables(values: Variables) -> dict[str, str]:
    """``{VARIABLE: text}`` of ``values`` (``{"remote_url": url}`` ->
    ``{"LMCACHE_REMOTE_URL": url}``), for a mapping of variables handed on (a value of None is
    left out: not set).

    Raises:
        ConfigError: a value does not parse (names the key and the value).
    """
    return {name: out for name, out in _texts(values).items() if out is not None}


def _apply(
    env: MutableMapping[str, str], defaults: Mapping[str, Any], values: Mapping[str, Any]
) -> None:
    for name, value in _texts(defaults).items():
        if name not in env and value is not None:
            env[name] = value
    for name, value in _texts(values).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value


def child_env(
    base: Mapping[str, str] | None = None,
    defaults: Variables | None = None,
    **values: Unpack[Variables],
) -> dict[str, str]:
    """The environment of a child process: ``base`` (default: this process's environment), with
    ``defaults`` where it leaves a variable unset and ``values`` on top (None: unset).

    Raises:
        ConfigError: a value does not parse (names the key and the value).
    """
    env = dict(os.environ if base is None else base)
    _apply(env, defaults or {}, values)
    return env


def export(defaults: Variables | None = None, **values: Unpack[Variables]) -> None:
    """:func:`child_env` applied to this process's environment: for an engine started in this
    process (its workers inherit the environment; the connector reads it).

    Raises:
        ConfigError: a value does not parse (names the key and the value).
    """
    _apply(os.environ, defaults or {}, values)
