"""One vllm-ascend release's fixture: the vLLM release it pins, its attention backend, its model
runners (V1 and V2) and its worker."""

from __future__ import annotations

import ast
import re
from typing import Any

from .annotations import annotations_for
from .releases import SCHEMA, vkey
from .sources import (
    FuncDef,
    Sources,
    call_name,
    calls_in,
    class_method,
    find_class,
    own_nodes,
    params,
    src,
)
from .symbolic import returned_shapes

ASC = "vllm_ascend/"


def ascend_pins(s: Sources) -> dict[str, Any]:
    targets: dict[str, set[str]] = {}
    for path in s.glob(ASC):
        tree = s.tree(path)
        for node in ast.walk(tree):  # type: ignore[arg-type]
            if (
                isinstance(node, ast.Call)
                and call_name(node) == "vllm_version_is"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                targets.setdefault(node.args[0].value, set()).add(path)
    patch_dirs = sorted(
        {
            m.group(1)
            for n in s.names
            if (m := re.match(r"vllm_ascend/patch/\w+/(patch_\d+_\d+_\d+)/", n))
        }
    )
    out: dict[str, Any] = {
        "vllm_version_is": {k: len(v) for k, v in sorted(targets.items())},
        "vllm_version_is_source": "vllm_ascend/utils.py::vllm_version_is (files calling it)",
        "versioned_patch_dirs": patch_dirs,
    }
    docker = s.text("Dockerfile")
    if docker:
        m = re.search(r"ARG VLLM_TAG=(\S+)", docker)
        out["dockerfile_vllm_tag"] = m.group(1) if m else None
    meta = next((n for n in s.names if n.endswith("METADATA") or n == "PKG-INFO"), None)
    if meta:
        reqs = [
            line.split(":", 1)[1].strip()
            for line in (s.text(meta) or "").splitlines()
            if line.startswith("Requires-Dist:")
            and re.match(r"Requires-Dist:\s*(vllm|torch)", line)
        ]
        out["requires_dist_vllm_torch"] = reqs
    candidates = sorted(targets, key=vkey) if targets else []
    pinned = candidates[-1] if candidates else None
    if not pinned and patch_dirs:
        pinned = patch_dirs[-1].removeprefix("patch_").replace("_", ".")
    out["pinned_vllm"] = out.get("dockerfile_vllm_tag", "").lstrip("v") if docker else pinned
    return out


def ascend_backend(s: Sources) -> dict[str, Any]:
    out = {}
    for path in (ASC + "attention/attention_v1.py", ASC + "attention/attention.py"):
        tree = s.tree(path)
        cls = find_class(tree, "AscendAttentionBackend")
        if cls is None:
            continue
        shape = class_method(cls, "get_kv_cache_shape")
        out = {
            "class": cls.name,
            "source": src(path, cls.name),
            "name": [r["dims"] for r in returned_shapes(class_method(cls, "get_name"))],
            "get_kv_cache_shape": {
                "params": params(shape) if shape else None,
                "returns": returned_shapes(shape),
                "source": src(path, f"{cls.name}.get_kv_cache_shape"),
            },
        }
        for extra in (
            "get_bsh_kv_cache_shape",
            "get_supported_block_size",
            "get_supported_kernel_block_sizes",
        ):
            fn = class_method(cls, extra)
            if fn is not None:
                out[extra] = {
                    "returns": returned_shapes(fn),
                    "source": src(path, f"{cls.name}.{extra}"),
                }
        break
    return out


def ascend_runner(s: Sources) -> dict[str, Any]:
    path = ASC + "worker/model_runner_v1.py"
    tree = s.tree(path)
    cls = find_class(tree, "NPUModelRunner")
    out: dict[str, Any] = {
        "class": src(path, "NPUModelRunner") if cls else None,
        "bases": [ast.unparse(b) for b in cls.bases] if cls else None,
    }
    if cls is None:
        return out
    out["register_kv_caches"] = calls_in(s, [path], {"register_kv_caches"})
    stores: dict[str, str] = {}
    kv_views: dict[str, str] = {}
    for fn in cls.body:
        if not isinstance(fn, FuncDef):
            continue
        for node in own_nodes(fn):
            if not isinstance(node, ast.Assign):
                continue
            text = ast.unparse(node)
            targets = [ast.unparse(t) for t in node.targets]
            if any(t.startswith("kv_caches[") for t in targets):
                stores.setdefault(text, src(path, f"NPUModelRunner.{fn.name}"))
            if targets and targets[0] in ("k_cache", "v_cache", "kv_cache") and "view" in text:
                kv_views.setdefault(text, src(path, f"NPUModelRunner.{fn.name}"))
    out["kv_caches_stores"] = [{"code": c, "source": w} for c, w in sorted(stores.items())]
    out["k_v_views"] = [{"code": c, "source": w} for c, w in sorted(kv_views.items())]
    v2 = ASC + "worker/v2/attn_utils.py"
    if s.tree(v2) is not None:
        out["v2_runner_kv_caches_stores"] = sorted(
            {
                ast.unparse(n)
                for n in ast.walk(s.tree(v2))  # type: ignore[arg-type]
                if isinstance(n, ast.Assign)
                and any(ast.unparse(t).startswith("kv_caches[") for t in n.targets)
            }
        )
        out["v2_runner_source"] = v2
    for name in ("initialize_kv_cache", "load_model", "get_model"):
        fn = class_method(cls, name)
        out[name] = (
            {"source": src(path, f"NPUModelRunner.{name}"), "params": params(fn)} if fn else None
        )
    out["v2_runner"] = ascend_v2_runner(s)
    return out


def ascend_v2_runner(s: Sources) -> dict[str, Any] | None:
    """The V2 ``NPUModelRunner`` (``worker/v2/model_runner.py``): its bases and whether it
    defines ``load_model`` itself (null: inherited, from vLLM's V2 ``GPUModelRunner``)."""
    path = ASC + "worker/v2/model_runner.py"
    cls = find_class(s.tree(path), "NPUModelRunner")
    if cls is None:
        return None
    fn = class_method(cls, "load_model")
    return {
        "class": src(path, "NPUModelRunner"),
        "bases": [ast.unparse(b) for b in cls.bases],
        "load_model": (
            {"source": src(path, "NPUModelRunner.load_model"), "params": params(fn)} if fn else None
        ),
    }


def ascend_worker(s: Sources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in (ASC + "worker/worker_v1.py", ASC + "worker/worker.py"):
        tree = s.tree(path)
        cls = find_class(tree, "NPUWorker")
        if cls is None:
            continue
        calls = calls_in(s, [path], {"ensure_kv_transfer_initialized"})
        methods = sorted({c["source"].split("::")[1] for c in calls})
        out = {
            "class": src(path, "NPUWorker"),
            "bases": [ast.unparse(b) for b in cls.bases],
            "ensure_kv_transfer_initialized": calls,
            "kv_transfer_after_model_load": True
            if any(m.endswith(".initialize_from_config") for m in methods)
            else False
            if any(m.endswith("._init_worker_distributed_environment") for m in methods)
            else None,
        }
        # which runner the worker builds: every assignment to self.use_v2_model_runner
        choice = [
            (n.lineno, ast.unparse(n), src(path, f"NPUWorker.{fn.name}"))
            for fn in cls.body
            if isinstance(fn, FuncDef)
            for n in own_nodes(fn)
            if isinstance(n, ast.Assign)
            and any(ast.unparse(t) == "self.use_v2_model_runner" for t in n.targets)
        ]
        out["use_v2_model_runner"] = [{"code": c, "source": w} for _, c, w in sorted(choice)]
        for name in (
            "load_model",
            "initialize_from_config",
            "_init_worker_distributed_environment",
        ):
            fn = class_method(cls, name)
            out[name] = (
                {"source": src(path, f"NPUWorker.{name}"), "params": params(fn)} if fn else None
            )
        break
    return out


def record_ascend(s: Sources, version: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "package": "vllm-ascend",
        "version": version,
        "artifact": s.artifact(),
        "pins": ascend_pins(s),
        "attention_backend": ascend_backend(s),
        "model_runner": ascend_runner(s),
        "worker": ascend_worker(s),
        "annotations": annotations_for("vllm-ascend", version),
    }
