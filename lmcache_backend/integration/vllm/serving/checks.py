"""What ``lmcache-backend serve`` checks before vLLM starts, so that a mistake costs one line
instead of an engine start-up and a page of tracebacks: the connector's configuration (the
``LMCACHE_*`` variables, ``LMCACHE_CONFIG_FILE`` and a ``--kv-transfer-config`` of your own), the
model (its layers against ``blend_check_layers``), and on a CPU the memory for vLLM's KV cache.

On a CPU, vLLM reserves ``--gpu-memory-utilization`` (0.9 by default) of **all** the machine's
memory unless ``VLLM_CPU_KVCACHE_SPACE`` (GiB) or ``--kv-cache-memory-bytes`` says how much KV
cache to allocate, and stops at start-up when that much is not free. When none of the three is
given, ``serve`` sets ``VLLM_CPU_KVCACHE_SPACE`` to half of the memory free now after the model's
weights and the CPU segment store's capacity (``max_local_cpu_size``), and says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_backend.config import BlendConfig, load_config
from lmcache_backend.errors import UsageError
from lmcache_backend.settings import ENVIRONMENT
from lmcache_backend.settings.environment import environment
from lmcache_backend.settings.writer import Variables, variable

GIB = 1024**3
GB = 1e9
KV_SPACE_ENV = variable("vllm_cpu_kvcache_space")
KV_TRANSFER_FLAG = "--kv-transfer-config"
#: what the process itself holds besides weights, KV cache and store (Python, torch, vLLM)
PROCESS_RESERVE_BYTES = 2 * GIB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def option_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag VALUE`` or ``--flag=VALUE``; the last one
    counts, as in argparse), or None when it is absent."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def connector_extra(argv: list[str]) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` of the ``--kv-transfer-config`` in ``argv`` ({} when
    there is none).

    Raises:
        UsageError: the value is not a JSON object, or its extra config is not one.
    """
    raw = option_value(argv, KV_TRANSFER_FLAG)
    if raw is None:
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{KV_TRANSFER_FLAG} {raw!r} is not JSON: {exc}") from None
    extra = config.get("kv_connector_extra_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(extra or {}, dict):
        raise UsageError(
            f"{KV_TRANSFER_FLAG} {raw!r}: expected a JSON object whose "
            "kv_connector_extra_config is an object"
        )
    return dict(extra or {})


def model_layers(model_dir: Path) -> int | None:
    """``num_hidden_layers`` of a model folder's ``config.json`` (or of its ``text_config``),
    None when the folder does not say."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        layers = section.get("num_hidden_layers") if isinstance(section, dict) else None
        if isinstance(layers, int):
            return layers
    return None


def check_config(argv: list[str], model: str) -> BlendConfig:
    """Load the configuration the connector will load, and check it against the model.

    Raises:
        ConfigError: a setting is invalid (the message names the key, its source and value).
        UsageError: ``--kv-transfer-config`` is not a JSON object.
    """
    from lmcache_backend.settings import CONNECTOR, parse_given
    from lmcache_backend.storage.settings import store_settings

    extra = connector_extra(argv)
    parse_given(CONNECTOR, extra, "kv_connector_extra_config")  # the connector's own keys
    config = load_config(**extra)  # the engine keys (it leaves the connector's alone)
    layers = model_layers(Path(model))
    if layers is not None:
        config.validate_for_model(layers)
    store_settings(config)  # the store's extra_config keys
    return config


def weights_bytes(model: str) -> int:
    """The size of a model folder's weight files (a GGUF file's size), 0 when unknown (a hub
    name): what loading the model takes, at most (vLLM may serve fp32 weights in bf16)."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES)


@dataclass(frozen=True)
class Memory:
    """The machine's memory now, in bytes."""

    total: int
    available: int


def memory_now() -> Memory:
    import psutil  # vLLM depends on it

    vm = psutil.virtual_memory()
    return Memory(total=int(vm.total), available=int(vm.available))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def cpu_kv_cache(
    argv: list[str],
    env: Mapping[str, str],
    memory: Memory,
    weights: int,
    store_bytes: float,
) -> tuple[Variables, str | None]:
    """Check or choose the KV-cache memory of vLLM's CPU build.

    Args:
        argv: the ``vllm serve`` arguments.
        env: the environment vLLM will see.
        memory: the machine's memory now.
        weights: bytes of the model's weights.
        store_bytes: the CPU segment store's capacity (0 without it).

    Returns:
        ``(variables to set, message)``: ``{"vllm_cpu_kvcache_space": N}`` (for
        :func:`~lmcache_backend.settings.writer.export`) and the line saying so when ``serve``
        chooses the size, else ``({}, None)``.

    Raises:
        UsageError: ``VLLM_CPU_KVCACHE_SPACE`` is not a whole number of GiB >= 1 or exceeds the
            free memory; ``--gpu-memory-utilization`` is not in (0, 1] or asks for more than
            is free; too little memory is free for any KV cache.
    """
    raw = env.get(KV_SPACE_ENV, "")
    free_gib = int(memory.available // GIB)
    if raw != "":
        parse = ENVIRONMENT[KV_SPACE_ENV].parse
        try:
            space = parse(raw)
        except (TypeError, ValueError):
            space = None
        if space is None:
            raise UsageError(f"{KV_SPACE_ENV}={raw!r}: expected {parse.accepts}")
        if space * GIB > memory.available:
            raise UsageError(
                f"{KV_SPACE_ENV}={space} (GiB) is more than the {_gib(memory.available)} of "
                f"memory free now: set at most {max(free_gib - 1, 1)}, or unset it and serve "
                "picks a size"
            )
        return {}, None
    if option_value(argv, "--kv-cache-memory-bytes") is not None:
        return {}, None  # vLLM checks it against free memory itself
    utilization = option_value(argv, "--gpu-memory-utilization")
    if utilization is not None:
        try:
            share = float(utilization)
        except ValueError:
            share = math.nan
        if not 0 < share <= 1:
            raise UsageError(
                f"--gpu-memory-utilization {utilization!r}: expected a fraction in (0, 1]"
            )
        if share * memory.total > memory.available:
            raise UsageError(
                f"--gpu-memory-utilization {utilization}: on a CPU vLLM reserves that share of "
                f"all {_gib(memory.total)} of memory, and only {_gib(memory.available)} is free; "
                f"lower it, or drop it and set {KV_SPACE_ENV} (GiB of KV cache)"
            )
        return {}, None
    spare = memory.available - weights - store_bytes - PROCESS_RESERVE_BYTES
    space = int(spare / 2 // GIB)
    if space < 1:
        raise UsageError(
            f"not enough free memory for a KV cache: {_gib(memory.available)} free, the weights "
            f"take {_gib(weights)}, the CPU segment store up to {_gib(store_bytes)} "
            f"(max_local_cpu_size); free memory, lower LMCACHE_MAX_LOCAL_CPU_SIZE or set "
            f"{KV_SPACE_ENV} (GiB)"
        )
    message = (
        f"{KV_SPACE_ENV} is not set: using {space} GiB for vLLM's KV cache (half of the "
        f"{_gib(spare)} free after the weights, the CPU segment store and the process); "
        f"set {KV_SPACE_ENV} to choose"
    )
    return {"vllm_cpu_kvcache_space": space}, message


def preflight(
    argv: list[str], env: Mapping[str, str] | None = None
) -> tuple[Variables, str | None]:
    """Every check, on the ``vllm serve`` arguments ``argv`` (``["serve", MODEL, ...]``).

    Returns:
        What :func:`cpu_kv_cache` returns on a CPU, ``({}, None)`` elsewhere.

    Raises:
        ConfigError, UsageError: one line naming what is wrong and what is accepted.
    """
    from lmcache_backend.device import detect_platform

    env = environment() if env is None else env
    model = argv[1]
    config = check_config(argv, model)
    if detect_platform() != "cpu":
        return {}, None
    store = config.max_local_cpu_size * GB if config.local_cpu else 0.0
    return cpu_kv_cache(argv, env, memory_now(), weights_bytes(model), store)
