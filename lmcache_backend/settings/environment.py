"""Variables read from the environment only, and :func:`read_variable`, the one place this package
reads a setting from ``os.environ`` (engine keys' ``LMCACHE_<KEY>`` variables are read by
:mod:`lmcache_backend.settings.sources` through :func:`environment`).

Besides its own variables the package reads a few of other projects' (vLLM's, Triton's, the XDG
base directory's); they are declared here too, with their owner, so that the docs list every
variable that changes what the package does. The test suite's two ``LMCACHE_*`` knobs are
declared (owner: the test suite; the tests read them) so that setting them never draws an
"unknown key" warning. The vLLM variables the package only *sets* for the engines it starts are
declared too (their owner: vLLM), so that every variable it writes goes through one writer
(:mod:`lmcache_backend.settings.writer`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lmcache_backend.settings import parsers as p
from lmcache_backend.settings.setting import Scope, Setting

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
#: ``extra_config`` key that forces the LMCache hooks as the variable does
FORCE_LMCACHE_EXTRA_KEY = "lmcache_backend.force_lmcache"


def _variable(name: str, parse: p.Parser, default, description: str, **more) -> Setting:
    return Setting(name, Scope.ENVIRONMENT, parse, default, description, **more)


_PATH = p.path()

ENVIRONMENT_VARIABLES: tuple[Setting, ...] = (
    _variable(CONFIG_FILE_ENV, _PATH, None, "YAML file of engine keys"),
    _variable(
        "LMCACHE_KERNEL_CACHE",
        _PATH,
        None,
        "where the CPU backend builds its tiled attention kernel",
        default_doc="`~/.cache/lmcache_backend/kernels`",
    ),
    _variable(
        "LMCACHE_BACKEND_CACHE_DIR",
        _PATH,
        None,
        "where the embedded models are converted to safetensors on first use",
        default_doc="`$XDG_CACHE_HOME/lmcache_backend`, else `~/.cache/lmcache_backend`",
    ),
    _variable(
        "LMCACHE_BACKEND_FORCE_LMCACHE",
        p.optional(p.boolean(), p.boolean().accepts),  # set but empty: not forced
        False,
        "hook into an LMCache / vLLM combination outside the version matrix",
        details=f"also the `extra_config` key `{FORCE_LMCACHE_EXTRA_KEY}` ([lmcache.md]"
        "(docs/lmcache.md))",
    ),
    _variable(
        "VLLM_LOGGING_LEVEL",
        p.text(),
        "INFO",
        "level of the connector's log lines when the application configured no logging",
        owner="vLLM",
    ),
    _variable(
        "VLLM_CPU_OMP_THREADS_BIND",
        p.optional(p.text(), "a list of cores, e.g. 0-1"),
        None,
        "vLLM's CPU core binding; `lmcache-backend bench --engine vllm` passes it on",
        details="an engine with a KV connector reserves one more core per worker, so bind both "
        "engines explicitly (e.g. `0-1`) to compare them ([why]"
        "(docs/measurements/core-binding.md))",
        owner="vLLM",
    ),
    _variable(
        "VLLM_CPU_KVCACHE_SPACE",
        p.optional(p.integer(minimum=1), "a whole number of GiB >= 1"),
        None,
        "GiB of KV cache vLLM's CPU build allocates",
        details="`lmcache-backend serve` checks it against the free memory before vLLM starts, "
        "and sets it to half of what is free after the weights and the CPU segment store when "
        "neither it, `--kv-cache-memory-bytes` nor `--gpu-memory-utilization` is given",
        default_doc="vLLM's: a share of all memory (`serve` picks one)",
        owner="vLLM",
    ),
    _variable(
        "VLLM_CPU_ATTN_SPLIT_KV",
        p.optional(p.boolean(), "true or false"),
        None,
        "vLLM's KV split in its CPU attention; the connector follows vLLM's setting",
        default_doc="vLLM's (on)",
        owner="vLLM",
    ),
    # set, not read: for the engines this package starts (lmcache_backend.settings.writer)
    _variable(
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        p.optional(p.boolean(), "true or false"),
        None,
        "lets vLLM send a function to its workers pickled; `verify` and the hardware check set "
        "it for the engines they start, whose workers run the checks' own functions",
        default_doc="vLLM's (off)",
        owner="vLLM",
    ),
    _variable(
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        p.optional(p.boolean(), "true or false"),
        None,
        "vLLM's engine core in a process of its own; "
        "`python -m lmcache_backend.bench.profiling.profile --ops` turns it off, "
        "so that the profiler sees the worker",
        default_doc="vLLM's (on)",
        owner="vLLM",
    ),
    _variable(
        "VLLM_USE_V2_MODEL_RUNNER",
        p.optional(p.boolean(), "true or false"),
        None,
        "vLLM's second model runner; `hardware-check --steps vllm` turns it off (it needs a "
        "compiled op the step's stand-in does not provide)",
        default_doc="vLLM's",
        owner="vLLM",
    ),
    _variable(
        "VLLM_USE_FLASHINFER_SAMPLER",
        p.optional(p.boolean(), "true or false"),
        None,
        "vLLM's FlashInfer sampling kernels; `hardware-check --steps vllm` turns them off "
        "(Triton and torch sample instead)",
        default_doc="vLLM's",
        owner="vLLM",
    ),
    _variable(
        "VLLM_NO_USAGE_STATS",
        p.optional(p.boolean(), "true or false"),
        None,
        "stops vLLM's usage report; `hardware-check --steps vllm` sets it on a machine without "
        "network",
        default_doc="vLLM's (reports)",
        owner="vLLM",
    ),
    _variable(
        "VLLM_ATTENTION_BACKEND",
        p.optional(p.text(allow_empty=False), "a name of vLLM's attention backend enum"),
        None,
        "vLLM's attention backend in releases that read the variable; the hardware check sets "
        "it for each backend it verifies",
        default_doc="vLLM's choice",
        owner="vLLM",
    ),
    _variable(
        "VLLM_V1_USE_PREFILL_DECODE_ATTENTION",
        p.optional(p.text(), "true or 1 (any case) for on, as vLLM reads it"),
        None,
        "vLLM 0.10's switch to another read of the TRITON_ATTN cache; the connector refuses "
        "that cache at start-up when it is on",
        details="vLLM reads this KV-cache form in another element order then "
        "(`PagedAttention.split_kv_cache`), one CacheBlend does not write",
        owner="vLLM",
    ),
    _variable(
        "REDIS_SERVICE_NAME",
        p.optional(p.text(allow_empty=False)),
        None,
        "the Sentinel master's name when neither the `redis-sentinel://` URL's path nor "
        "`extra_config.remote_sentinel_master` gives it",
        default_doc="unset: `redismaster`",
        owner="LMCache",
    ),
    _variable(
        "TRITON_INTERPRET",
        p.optional(p.boolean(), "true or false (1/0)"),
        None,
        "run the CUDA backend's Triton kernels in Triton's interpreter, on CPU tensors",
        details="for tests without a GPU ([cuda.md](docs/cuda.md))",
        owner="Triton",
    ),
    _variable(
        "OMP_NUM_THREADS",
        p.optional(p.integer(minimum=1), "an integer >= 1"),
        None,
        "threads of torch's CPU kernels; the benchmarks report it",
        default_doc="the CPU count (`lmcache-backend` sets it when unset)",
        owner="OpenMP",
    ),
    # knobs of the test suite: declared so that setting them is never an "unknown key"
    _variable(
        "LMCACHE_TEST_REAL_MODELS",
        p.optional(p.boolean(), "1"),
        None,
        "run the tests marked `real_model` (engines on Gemma 3 270M)",
        owner="the test suite",
    ),
    _variable(
        "LMCACHE_BACKEND_SKIP_TP",
        p.optional(p.boolean(), "1"),
        None,
        "leave out the tensor-parallel engine test (`tests/integration/vllm/test_vllm_tp.py`)",
        owner="the test suite",
    ),
    _variable(
        "XDG_CACHE_HOME",
        _PATH,
        None,
        "base of `LMCACHE_BACKEND_CACHE_DIR`'s default",
        default_doc="`~/.cache`",
        owner="XDG",
    ),
)

_BY_NAME = {setting.name: setting for setting in ENVIRONMENT_VARIABLES}


def environment() -> Mapping[str, str]:
    """The process environment (the mapping :func:`read_variable` reads by default)."""
    return os.environ


def read_variable(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of the declared variable ``name`` (its default when unset), parsed.

    Raises:
        KeyError: ``name`` is not declared in :data:`ENVIRONMENT_VARIABLES`.
        ConfigError: its value does not parse (the message names the variable and the value).
    """
    setting = _BY_NAME[name]
    raw = (environment() if env is None else env).get(name)
    if raw is None:
        return setting.default_value()
    return setting.value(raw, "environment")
