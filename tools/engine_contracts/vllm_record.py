"""One vLLM release's fixture, section by section."""

from __future__ import annotations

from typing import Any

from .annotations import annotations_for
from .releases import SCHEMA
from .sources import Sources
from .vllm_attention import attention_backends
from .vllm_connector import connector_api
from .vllm_hooks import hooks
from .vllm_kv_caches import registered_caches
from .vllm_layout import layout_selection
from .vllm_runner import kv_transfer_timing, platform_api, runner_selection


def record_vllm(s: Sources, version: str) -> dict[str, Any]:
    layout = layout_selection(s)
    return {
        "schema": SCHEMA,
        "package": "vllm",
        "version": version,
        "artifact": s.artifact(),
        "kv_cache_layout": layout,
        "attention_backends": attention_backends(s, layout),
        "registered_kv_caches": registered_caches(s),
        "model_runner_selection": runner_selection(s),
        "connector_api": connector_api(s),
        "kv_transfer_init": kv_transfer_timing(s),
        "hooks": hooks(s),
        "platform": platform_api(s),
        "annotations": annotations_for("vllm", version),
    }
