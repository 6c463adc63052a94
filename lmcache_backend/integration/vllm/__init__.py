"""CacheBlend inside vLLM: the ``CacheBlendConnector`` KV connector, the model-recording plugin,
and the vLLM model adapter. Importing this package does not import vLLM."""

from __future__ import annotations

import importlib.metadata
from typing import Any

CONNECTOR_MODULE = "lmcache_backend.integration.vllm.connector"
CONNECTOR_NAME = "CacheBlendConnector"
PLUGIN_ENTRY_POINT = "lmcache_backend.integration.vllm.plugin:register"


def kv_transfer_config(stats_file: str | None = None, **extra) -> dict:
    """The ``--kv-transfer-config`` value that loads ``CacheBlendConnector`` (for the offline
    ``LLM`` class: ``KVTransferConfig(**kv_transfer_config(...))``).

    Args:
        stats_file: where the connector appends one JSON line per blended request.
        extra: further ``kv_connector_extra_config`` keys (``blend_recompute_ratios``, ...).
    """
    config: dict = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
    }
    extra = {k: v for k, v in extra.items() if v is not None}
    if stats_file:
        extra["stats_file"] = stats_file
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def _entry_point_registered() -> bool:
    try:
        group = importlib.metadata.entry_points(group="vllm.general_plugins")
    except Exception:  # noqa: BLE001 - broken metadata should not break doctor
        return False
    return any(ep.value == PLUGIN_ENTRY_POINT for ep in group)


#: The attention path of the blend's selected queries on each platform
#: (:mod:`lmcache_backend.integration.vllm.worker_side.attention_choice`).
ATTENTION_PATHS = {
    "cpu": "the tiled CPU kernel (or vLLM's CPU paged attention) over the request's blocks; "
    "selected tokens through vLLM's compiled forward",
    "cuda": "paged_attention_at_positions (Triton) through the block table; layers streamed "
    "one at a time",
    "npu": "torch-npu fused attention over one layer's gathered rows; layers streamed one at "
    "a time",
}


def _engine_rows(platform: str, engine_here: bool, versions: Any = None) -> list[tuple[str, str]]:
    """The gate's decision for ``versions`` (default: the installed ones) on ``platform`` and
    what the code path uses."""
    from lmcache_backend.compat import matrix_row
    from lmcache_backend.compat.ascend import NPU_KV_CACHE_LAYOUT
    from lmcache_backend.compat.gate import decide, installed_probe
    from lmcache_backend.compat.profile import GPU_V2
    from lmcache_backend.compat.versions import detect_versions
    from lmcache_backend.compat.vllm import v2_runner_default

    what_if = versions is not None
    versions = versions or detect_versions()
    # a release that is not installed cannot be probed: only recorded releases have a path
    probe = None if what_if else installed_probe
    ascend = versions.vllm_ascend if platform == "npu" else None
    row = matrix_row(versions.vllm, None, ascend) if versions.vllm else None
    rows = [("matrix row", row.describe() if row else "none (see docs/vllm.md#versions)")]
    decision = decide(versions, platform, False, probe)
    if not decision.runs and decision.untested:
        forced = decide(versions, platform, True, probe)
        rows.append(("gate", f"refused: {decision.message}"))
        rows.append(("with allow_untested", forced.message))
        decision = forced
    else:
        rows.append(("gate", ("runs: " if decision.runs else "refused: ") + decision.message))
    profile = decision.profile
    if profile is None:
        return rows
    span = f"vLLM {profile.first} to {profile.last}"
    given = "asked" if what_if else "installed"
    rows.append(("code path", f"{profile.name} (covers {span}; {given} {profile.release})"))
    when = "in this engine" if engine_here else "no engine running here; an engine will use"
    rows.append(("platform", f"{platform} ({when})"))
    rows.append(("attention path", ATTENTION_PATHS.get(platform, "none")))
    layout = NPU_KV_CACHE_LAYOUT if platform == "npu" else profile.kv_cache_layouts.get(platform)
    rows.append(("KV-cache layout", layout.describe() if layout else "not recorded"))
    sm100 = profile.kv_cache_layouts.get("cuda-sm100") if platform == "cuda" else None
    if sm100 is not None:
        rows.append(("KV-cache layout, SM100", sm100.describe()))
    runners = ", ".join(r.label for r in profile.runners(platform)) or "none"
    rows.append(("model runners", runners))
    # vLLM's own choice; vllm-ascend decides for itself on an NPU
    v2_default = v2_runner_default(profile.release) if platform == "cuda" else None
    if v2_default is not None and GPU_V2 in profile.runners(platform):
        rows.append(("V2 runner by default for", v2_default))
    return rows


def what_if_section(vllm: str, platform: str, vllm_ascend: str | None = None) -> tuple:
    """``doctor --vllm X --platform P``: what the connector would do with vLLM ``vllm`` (and
    vllm-ascend ``vllm_ascend``) on ``platform``, whatever is installed here."""
    from lmcache_backend.compat.versions import Versions

    versions = Versions(vllm=vllm, vllm_ascend=vllm_ascend, lmcache=None, torch=None)
    rows = [("vLLM", vllm), ("vllm-ascend", vllm_ascend or "none")]
    rows += _engine_rows(platform, False, versions)
    return f"vLLM integration, if vLLM {vllm} ran on {platform}", rows


def doctor_section() -> tuple[str, list[tuple[str, str]]]:
    """``(title, [(label, value), ...])`` describing the vLLM integration in this environment:
    versions, the matrix row, the gate's decision, the code path and, without an engine in this
    process, what an engine here would use (platform, attention path, KV-cache layout)."""
    from lmcache_backend.compat.versions import detect_versions
    from lmcache_backend.device import detect_platform, engine_platform
    from lmcache_backend.integration.vllm.plugin import hook_status

    versions = detect_versions()
    status = hook_status()
    rows: list[tuple[str, str]] = [
        ("vLLM", versions.vllm or "not installed"),
        ("vllm-ascend", versions.vllm_ascend or "not installed"),
        ("LMCache", versions.lmcache or "not installed"),
    ]
    # inside an engine vLLM has resolved the platform already; elsewhere torch tells, without
    # importing vLLM (seconds)
    engine_here = bool(status["model_recorded"])
    platform = engine_platform() if engine_here else detect_platform()
    try:
        rows += _engine_rows(platform, engine_here)
    except Exception as exc:  # noqa: BLE001 - report, do not fail
        rows.append(("gate", f"unavailable: {exc}"))
    try:
        from lmcache_backend.config import load_config
        from lmcache_backend.ops import get_ops

        rows.append(("backend in use", get_ops(load_config().backend).name))
    except Exception as exc:  # noqa: BLE001 - report, do not fail
        rows.append(("backend in use", f"unavailable: {exc}"))
    rows.append(("plugin entry point", "registered" if _entry_point_registered() else "missing"))
    hook = ", ".join(status["wrapped"]) or "not installed in this process"
    rows.append(("plugin hook", hook))
    rows.append(("model recorded", "yes" if engine_here else "no (no engine here)"))
    rows.append(("connector", f"{CONNECTOR_NAME} from {CONNECTOR_MODULE}"))
    return "vLLM integration", rows
