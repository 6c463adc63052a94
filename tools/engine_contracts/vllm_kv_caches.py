"""vLLM ``registered_kv_caches``: the ``register_kv_caches`` and
``register_cross_layers_kv_cache`` call sites, and the functions that build the dict they get."""

from __future__ import annotations

import ast
from typing import Any

from .sources import Sources, call_name, calls_in, find_def, own_nodes, params, src
from .vllm_paths import V2_ATTN, WORKER_DIR

BUILDERS = {
    "initialize_kv_cache_tensors",
    "_allocate_kv_cache_tensors",
    "_reshape_kv_cache_tensors",
    "allocate_uniform_kv_caches",
    "allocate_kv_cache",
    "create_kv_cache_views",
    "map_kv_caches_to_kernel_blocks",
    "_update_hybrid_attention_mamba_layout",
    "bind_kv_cache",
}

MARKERS = (
    "get_kv_cache_shape",
    "get_kv_cache_stride_order",
    "permute",
    "kernel_block_size",
    "as_strided",
    "layer_view_order",
)


def builder_chain(s: Sources, path: str, qual: str) -> list[dict[str, Any]]:
    """The functions that build the dict handed to ``register_kv_caches``, from ``qual``
    down: the builder calls each makes and the markers of its body (what it uses)."""
    helpers = [path, WORKER_DIR + "utils.py", "vllm/v1/kv_cache_interface.py", V2_ATTN]
    mixin = WORKER_DIR + "kv_connector_model_runner_mixin.py"
    cls_name = qual.split(".")[0] if "." in qual else None
    chain: list[dict[str, Any]] = []
    todo = [(path, qual)]
    seen: set[str] = set()
    while todo:
        where, name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        fn = find_def(s.tree(where), name)
        if fn is None:
            continue
        text = ast.unparse(fn)
        called: list[str] = []
        nodes = sorted(
            (n for n in own_nodes(fn) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        )
        for node in nodes:
            if call_name(node) in BUILDERS and call_name(node) not in called:
                called.append(call_name(node))
        chain.append(
            {"source": src(where, name), "calls": called, "uses": [m for m in MARKERS if m in text]}
        )
        for callee in called:
            if callee == "bind_kv_cache":
                continue
            if cls_name and find_def(s.tree(path), f"{cls_name}.{callee}") is not None:
                todo.append((path, f"{cls_name}.{callee}"))
            elif find_def(s.tree(mixin), f"KVConnectorModelRunnerMixin.{callee}") is not None:
                todo.append((mixin, f"KVConnectorModelRunnerMixin.{callee}"))
            else:
                for cand in helpers:
                    if find_def(s.tree(cand), callee) is not None:
                        todo.append((cand, callee))
                        break
    return chain


def registered_caches(s: Sources) -> dict[str, Any]:
    runner = WORKER_DIR + "gpu_model_runner.py"
    worker_files = [p for p in s.glob(WORKER_DIR) if p.count("/") <= 4]
    out: dict[str, Any] = {
        "register_kv_caches": calls_in(s, worker_files, {"register_kv_caches"}),
        "register_cross_layers_kv_cache": calls_in(
            s, worker_files, {"register_cross_layers_kv_cache"}
        ),
        "builders": builder_chain(s, runner, "GPUModelRunner.initialize_kv_cache"),
    }
    if find_def(s.tree(V2_ATTN), "init_kv_cache") is not None:
        out["builders_v2_runner"] = builder_chain(s, V2_ATTN, "init_kv_cache")
    kvc = find_def(s.tree(runner), "GPUModelRunner.initialize_kv_cache")
    if kvc is not None:
        out["initialize_kv_cache_params"] = params(kvc)
    return out
