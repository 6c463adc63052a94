"""CacheBlend inside vLLM: the ``CacheBlendConnector`` KV connector, the model-recording plugin,
and the vLLM model adapter. Importing this package does not import vLLM."""

from __future__ import annotations

import importlib.metadata

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


def doctor_section() -> tuple[str, list[tuple[str, str]]]:
    """``(title, [(label, value), ...])`` describing the vLLM integration in this environment."""
    from lmcache_backend.compat import UnsupportedVersions, detect_versions, matrix_row
    from lmcache_backend.compat.vllm import check_versions

    versions = detect_versions()
    rows: list[tuple[str, str]] = [
        ("vLLM", versions.vllm or "not installed"),
        ("LMCache", versions.lmcache or "not installed"),
    ]
    row = matrix_row(versions.vllm, None) if versions.vllm else None
    rows.append(("matrix row", row.describe() if row else "none"))
    try:
        profile = check_versions()
        rows.append(("code path", f"vLLM {profile.release}"))
    except UnsupportedVersions as exc:
        rows.append(("code path", f"unsupported: {exc}"))
    try:
        from lmcache_backend.config import load_config
        from lmcache_backend.ops import get_ops

        rows.append(("backend in use", get_ops(load_config().backend).name))
    except Exception as exc:  # noqa: BLE001 - report, do not fail
        rows.append(("backend in use", f"unavailable: {exc}"))
    rows.append(("plugin entry point", "registered" if _entry_point_registered() else "missing"))
    from lmcache_backend.integration.vllm.plugin import hook_status

    status = hook_status()
    hook = ", ".join(status["wrapped"]) or "not installed in this process"
    rows.append(("plugin hook", hook))
    rows.append(("model recorded", "yes" if status["model_recorded"] else "no (no engine here)"))
    rows.append(("connector", f"{CONNECTOR_NAME} from {CONNECTOR_MODULE}"))
    return "vLLM integration", rows
