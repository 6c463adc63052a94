"""The vLLM types the connector's signatures name (for type checkers and editors only, under
``TYPE_CHECKING``) are the ones every supported release keeps at the same place, and the
installed vLLM has each where the import says."""

from __future__ import annotations

import ast
import importlib

from repo_paths import REPO_ROOT

#: ``(module, name)`` at the same place in the oldest supported release (0.9.2) and the one run
#: here (0.32.0), read from their released sources. Not here, so named ``Any``:
#: ``AttentionMetadata`` (moved) and ``KVConnectorOutput`` (not in 0.9.2).
AGREED = {
    ("vllm.config", "VllmConfig"),
    ("vllm.forward_context", "ForwardContext"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks"),
    ("vllm.v1.core.sched.output", "SchedulerOutput"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    ("vllm.v1.request", "Request"),
}


def _type_checking_imports() -> dict[tuple[str, str], list[str]]:
    """``(module, name) -> [files]`` of the vLLM imports under ``if TYPE_CHECKING:``."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted((REPO_ROOT / "lmcache_backend" / "integration" / "vllm").rglob("*.py")):
        tree = ast.parse(path.read_text("utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                for stmt in ast.walk(node):
                    if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("vllm"):
                        for alias in stmt.names:
                            key = (stmt.module or "", alias.name)
                            found.setdefault(key, []).append(path.name)
    return found


def test_the_connector_names_only_types_every_release_keeps() -> None:
    found = _type_checking_imports()
    assert {"connector.py", "scheduler.py"} <= set(found[("vllm.v1.request", "Request")])
    assert set(found) <= AGREED, sorted(set(found) - AGREED)


def test_the_installed_vllm_has_each_named_type() -> None:
    for module, name in sorted(AGREED):
        assert hasattr(importlib.import_module(module), name), (module, name)
