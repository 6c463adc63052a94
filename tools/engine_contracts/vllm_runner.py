"""vLLM ``model_runner_selection``, ``kv_transfer_init`` and ``platform``: which GPU model runner
the worker uses, when the connector is created relative to ``load_model``, and the ``Platform``
API used to detect the device."""

from __future__ import annotations

import ast
from typing import Any

from .sources import (
    Sources,
    call_name,
    calls_in,
    class_attribute,
    find_class,
    find_def,
    own_nodes,
    params,
    src,
)
from .symbolic import returned_shapes
from .vllm_paths import V2_RUNNER, WORKER_DIR


def env_default(s: Sources, name: str) -> str | None:
    """The default expression of ``vllm.envs.<name>`` (the lambda of ``environment_variables``)."""
    tree = s.tree("vllm/envs.py")
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == name:
                    body = value.body if isinstance(value, ast.Lambda) else value
                    return ast.unparse(body)
    return None


def runner_selection(s: Sources) -> dict[str, Any]:
    """Which GPU model runner the worker uses: V1 (``gpu_model_runner.py``) or V2
    (``gpu/model_runner.py``), and what makes V2 the default."""
    config = "vllm/config/vllm.py"
    tree = s.tree(config)
    out: dict[str, Any] = {
        "env_VLLM_USE_V2_MODEL_RUNNER": env_default(s, "VLLM_USE_V2_MODEL_RUNNER"),
        "v1_runner": src(WORKER_DIR + "gpu_model_runner.py", "GPUModelRunner"),
    }
    v2 = find_def(s.tree(V2_RUNNER), "GPUModelRunner")
    out["v2_runner"] = src(V2_RUNNER, "GPUModelRunner") if v2 is not None else None
    load = find_def(s.tree(V2_RUNNER), "GPUModelRunner.load_model")
    out["v2_runner_load_model"] = (
        {"params": params(load), "source": src(V2_RUNNER, "GPUModelRunner.load_model")}
        if load is not None
        else None
    )
    for label, qual in (
        ("use_v2_model_runner", "VllmConfig.use_v2_model_runner"),
        ("is_default_v2_model_runner_model", "VllmConfig._is_default_v2_model_runner_model"),
    ):
        fn = find_def(tree, qual)
        out[label] = (
            {
                "returns": [{"value": r["dims"], "when": r["when"]} for r in returned_shapes(fn)],
                "source": src(config, qual),
            }
            if fn is not None
            else None
        )
    archs = None
    for node in tree.body if tree is not None else []:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == (
            "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"
        ):
            archs = sorted(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    out["default_v2_architectures"] = archs
    fn = find_def(tree, "VllmConfig._get_v2_model_runner_unsupported_features")
    if fn is not None:
        feats = []
        for node in own_nodes(fn):
            if isinstance(node, ast.Call) and call_name(node) in ("append", "extend") and node.args:
                arg = node.args[0]
                feats.append(arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg))
        out["v2_unsupported_features"] = {
            "values": sorted(feats),
            "source": src(config, "VllmConfig._get_v2_model_runner_unsupported_features"),
        }
    return out


def kv_transfer_timing(s: Sources) -> dict[str, Any]:
    """Where the GPU worker creates the connector (ensure_kv_transfer_initialized), relative to
    load_model, and the order in which the executor calls the worker."""
    path = WORKER_DIR + "gpu_worker.py"
    tree = s.tree(path)
    calls = calls_in(s, [path], {"ensure_kv_transfer_initialized"})
    # module-level helpers calling it, then the Worker methods calling those helpers
    helpers = {c["source"].split("::")[1] for c in calls if "." not in c["source"].split("::")[1]}
    callers = sorted(
        {c["source"].split("::")[1] for c in calls if "." in c["source"].split("::")[1]}
    )
    if helpers:
        via = calls_in(s, [path], helpers)
        callers += sorted({c["source"].split("::")[1] for c in via if "Worker." in c["source"]})
    rpc_order: list[str] = []
    for exe in ("vllm/v1/executor/uniproc_executor.py", "vllm/executor/uniproc_executor.py"):
        fn = find_def(s.tree(exe), "UniProcExecutor._init_executor")
        if fn is None:
            continue
        for node in sorted(
            (n for n in own_nodes(fn) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        ):
            name = call_name(node)
            if name == "collective_rpc" and node.args and isinstance(node.args[0], ast.Constant):
                rpc_order.append(node.args[0].value)
            elif name in ("init_worker", "init_device", "load_model") and "driver_worker" in (
                ast.unparse(node.func)
            ):
                rpc_order.append(name)
        executor_source = src(exe, "UniProcExecutor._init_executor")
        break
    else:
        executor_source = None
    after = None
    methods = [c.split(".")[-1] for c in callers]
    if "initialize_from_config" in methods:
        after = True  # the engine core calls it after load_model, once the KV cache is sized
    elif "init_device" in methods:
        after = False
    return {
        "ensure_kv_transfer_initialized": calls,
        "called_from_worker_methods": callers,
        "kv_transfer_after_model_load": after,
        "executor_rpc_order": rpc_order,
        "executor_source": executor_source,
        "initialize_from_config_source": "vllm/v1/engine/core.py::EngineCore._initialize_kv_caches",
        "worker_load_model_params": params(find_def(tree, "Worker.load_model"))
        if find_def(tree, "Worker.load_model")
        else None,
    }


PLATFORM_METHODS = (
    "is_cpu",
    "is_cuda",
    "is_rocm",
    "is_xpu",
    "is_tpu",
    "is_cuda_alike",
    "is_out_of_tree",
)


def platform_api(s: Sources) -> dict[str, Any]:
    path = "vllm/platforms/interface.py"
    tree = s.tree(path)
    out: dict[str, Any] = {}
    for name in PLATFORM_METHODS:
        fn = find_def(tree, f"Platform.{name}")
        out[name] = {"source": src(path, f"Platform.{name}"), "params": params(fn)} if fn else None
    for attr in ("device_type", "device_name", "dispatch_key"):
        owner = class_attribute(tree, "Platform", attr)
        out[attr] = {"source": src(path, f"{owner}.{attr}")} if owner else None
    enum = find_class(tree, "PlatformEnum")
    out["PlatformEnum"] = (
        [ast.unparse(n.targets[0]) for n in enum.body if isinstance(n, ast.Assign)]
        if enum
        else None
    )
    init = s.text("vllm/platforms/__init__.py") or ""
    out["current_platform"] = (
        {"source": "vllm/platforms/__init__.py::__getattr__", "lazy": True}
        if "def __getattr__" in init and "current_platform" in init
        else {"source": "vllm/platforms/__init__.py::current_platform"}
    )
    return out
