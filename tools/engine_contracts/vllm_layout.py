"""vLLM ``kv_cache_layout``: how the layout of the KV cache is chosen, and the ``KVCacheLayout``
enum of 0.29 on."""

from __future__ import annotations

import ast
import re
from typing import Any

from .sources import FuncDef, Sources, call_name, class_method, find_class, find_def, own_nodes, src
from .symbolic import layout_returns
from .vllm_paths import BACKENDS_DIR


def kv_cache_layout_enum(s: Sources) -> dict[str, Any] | None:
    """The 0.29+ KVCacheLayout enum: each member's stride order over [L, B, H, N, C] and the
    per-layer view order derived from it."""
    path = "vllm/v1/kv_cache_layout.py"
    cls = find_class(s.tree(path), "KVCacheLayout")
    if cls is None:
        return None
    prop = class_method(cls, "layer_view_order")
    formula = ast.unparse(prop.body[-1]) if prop is not None else None
    expected = "return tuple((i - 1 for i in self.value if i != _DIM_L))"
    members = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            order = [e.value for e in node.value.elts]  # type: ignore[attr-defined]
            entry: dict[str, Any] = {"stride_order_LBHNC": order}
            if formula == expected:
                entry["layer_view_order_BHNC"] = [i - 1 for i in order if i != 0]
            members[ast.unparse(node.targets[0])] = entry
    return {
        "members": members,
        "layer_view_order_formula": formula,
        "source": src(path, "KVCacheLayout"),
    }


def layout_selection(s: Sources) -> dict[str, Any]:
    """How the layout of the KV cache is chosen."""
    utils = BACKENDS_DIR + "utils.py"
    out: dict[str, Any] = {}
    tree = s.tree(utils)
    resolve = find_def(tree, "resolve_kv_cache_layout")
    if resolve is not None:
        out["resolver"] = src(utils, "resolve_kv_cache_layout")
        for node in tree.body:  # type: ignore[union-attr]
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == (
                "_DEFAULT_LAYOUT_PREFERENCE"
            ):
                out["default_preference"] = [
                    ast.unparse(e).split(".")[-1]
                    for e in node.value.elts  # type: ignore[attr-defined]
                ]
        alias = find_def(tree, "_layout_from_name")
        if alias is not None:
            out["legacy_aliases"] = {
                m.group(1): m.group(2)
                for m in re.finditer(r"'(NHD|HND)': KVCacheLayout\.(\w+)", ast.unparse(alias))
            }
        text = ast.unparse(resolve)
        out["order"] = [
            step
            for step, marker in (
                ("cache_config.kv_cache_layout", "cache_config.kv_cache_layout is not None"),
                ("envs.VLLM_KV_CACHE_LAYOUT", "VLLM_KV_CACHE_LAYOUT"),
                ("connector.get_required_kvcache_layout", "get_kv_connector_cache_layout"),
                ("candidates[0]", "candidates[0]"),
            )
            if marker in text
        ]
        out["enum"] = kv_cache_layout_enum(s)
        return out
    fn = find_def(tree, "get_kv_cache_layout")
    if fn is not None:
        text = ast.unparse(fn)
        out["resolver"] = src(utils, "get_kv_cache_layout")
        out["order"] = [
            step
            for step, marker in (
                ("set_kv_cache_layout override", "_KV_CACHE_LAYOUT_OVERRIDE"),
                ("envs.VLLM_KV_CACHE_LAYOUT", "VLLM_KV_CACHE_LAYOUT"),
                ("connector.get_required_kvcache_layout", "get_kv_connector_cache_layout"),
            )
            if marker in text
        ]
    for path in s.glob("vllm/distributed/kv_transfer/kv_connector/utils.py"):
        fn = find_def(s.tree(path), "get_kv_connector_cache_layout")
        if fn is not None:
            consts = [
                r["value"] for r in layout_returns(fn) if isinstance(r["value"], str)
            ]  # e.g. "'NHD'"
            out["default"] = consts[-1].strip("'\"") if consts else None
            out["default_source"] = src(path, "get_kv_connector_cache_layout")
    forced = []
    for path in sorted(s.glob("vllm/platforms/") + s.glob("vllm/attention/selector.py")) + s.glob(
        "vllm/v1/attention/selector.py"
    ):
        tree = s.tree(path)
        for top in ast.walk(tree):  # type: ignore[arg-type]
            if not isinstance(top, FuncDef):
                continue
            for node in own_nodes(top):
                if isinstance(node, ast.Call) and call_name(node) == "set_kv_cache_layout":
                    owner = next(
                        (
                            c.name
                            for c in ast.walk(tree)  # type: ignore[arg-type]
                            if isinstance(c, ast.ClassDef) and top in c.body
                        ),
                        None,
                    )
                    qual = f"{owner}.{top.name}" if owner else top.name
                    forced.append({"call": ast.unparse(node), "source": src(path, qual)})
    if forced:
        out["forced_by"] = forced
    return out
