"""vLLM ``attention_backends``: each backend's KV-cache shape and stride order, the layouts it
requires or supports, how its implementation takes K and V out of ``kv_cache`` (``kv_read``, and
through helpers: ``kv_read_helpers``), and the per-layer tensor ``register_kv_caches`` receives
(``registered_tensor``); then the composite backends built from them (``vllm_composite``)."""

from __future__ import annotations

import ast
from typing import Any

from .sources import FuncDef, Sources, class_method, find_class, own_nodes, params, src
from .symbolic import layout_returns, returned_shapes, returns, stride_orders
from .vllm_composite import composite_backends
from .vllm_paths import BACKENDS_DIR
from .vllm_read_helpers import kv_read_helpers

BACKEND_FILES = {
    "FLASH_ATTN": "flash_attn.py",
    "FLASHINFER": "flashinfer.py",
    "TRITON_ATTN": "triton_attn.py",
    "CPU_ATTN": "cpu_attn.py",
}


def backend_class(tree: ast.Module) -> ast.ClassDef | None:
    for node in tree.body:
        if (
            isinstance(node, ast.ClassDef)
            and node.name.endswith("Backend")
            and class_method(node, "get_name") is not None
        ):
            return node
    return None


def impl_class_name(backend: ast.ClassDef) -> str | None:
    fn = class_method(backend, "get_impl_cls")
    if fn is None:
        return None
    for _, value in returns(fn.body):
        if isinstance(value, ast.Name):
            return value.id
    return None


KV_OPS = {"unbind", "split", "permute", "transpose", "view", "chunk", "flatten", "unflatten"}


def target_text(node: ast.AST) -> str:
    """An assignment target, a tuple without parentheses."""
    if isinstance(node, ast.Tuple):
        return ", ".join(ast.unparse(e) for e in node.elts)
    return ast.unparse(node)


def _rooted_at_kv_cache(node: ast.AST) -> bool:
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id == "kv_cache"


def kv_reads(tree: ast.Module, impl_name: str | None, path: str) -> list[dict[str, str]]:
    """How the backend's implementation takes K and V (or a view of both) out of the layer's
    ``kv_cache``: the outermost ``kv_cache.<op>(...)`` chains, with their assignment target."""
    cls = find_class(tree, impl_name) if impl_name else None
    if cls is None:
        return []
    found: dict[str, str] = {}
    for fn in cls.body:
        if not isinstance(fn, FuncDef):
            continue
        for stmt in sorted(
            (n for n in own_nodes(fn) if isinstance(n, ast.stmt)), key=lambda n: n.lineno
        ):
            for node in ast.iter_child_nodes(stmt):
                for sub in ast.walk(node):
                    if (
                        isinstance(sub, ast.Call)
                        and isinstance(sub.func, ast.Attribute)
                        and sub.func.attr in KV_OPS
                        and _rooted_at_kv_cache(sub)
                    ):
                        text = ast.unparse(sub)
                        if isinstance(stmt, ast.Assign) and stmt.value is sub:
                            text = " = ".join(map(target_text, stmt.targets)) + " = " + text
                        found.setdefault(text, src(path, f"{cls.name}.{fn.name}"))
    codes = list(found)
    outer = [c for c in codes if not any(c != o and c in o for o in codes)]
    return [{"code": c, "source": found[c]} for c in outer[:8]]


def attention_backends(s: Sources, layout: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    enum = (layout.get("enum") or {}).get("members", {})
    default_pref = layout.get("default_preference") or []
    for key, fname in BACKEND_FILES.items():
        path = BACKENDS_DIR + fname
        tree = s.tree(path)
        cls = backend_class(tree) if tree is not None else None
        if cls is None:
            out[key] = None
            continue
        name = [r["dims"] for r in returned_shapes(class_method(cls, "get_name"))]
        entry: dict[str, Any] = {
            "class": cls.name,
            "source": src(path, cls.name),
            "name": [n if isinstance(n, str) else n for n in name],
        }
        shape_fn = class_method(cls, "get_kv_cache_shape")
        if shape_fn is not None:
            entry["get_kv_cache_shape"] = {
                "params": params(shape_fn),
                "returns": returned_shapes(shape_fn, s),
                "source": src(path, f"{cls.name}.get_kv_cache_shape"),
            }
        else:
            entry["get_kv_cache_shape"] = None
        stride_fn = class_method(cls, "get_kv_cache_stride_order")
        if stride_fn is not None:
            entry["get_kv_cache_stride_order"] = {
                **(stride_orders(stride_fn) or {}),
                "source": src(path, f"{cls.name}.get_kv_cache_stride_order"),
            }
        else:
            entry["get_kv_cache_stride_order"] = None
        req = class_method(cls, "get_required_kv_cache_layout")
        if req is not None:
            entry["required_kv_cache_layout"] = {
                "returns": layout_returns(req),
                "source": src(path, f"{cls.name}.get_required_kv_cache_layout"),
            }
        sup = class_method(cls, "supported_kv_cache_layouts")
        if enum:
            entry["supported_kv_cache_layouts"] = {
                "returns": layout_returns(sup) if sup is not None else [{"value": None}],
                "source": src(path, f"{cls.name}.supported_kv_cache_layouts")
                if sup is not None
                else src(
                    "vllm/v1/attention/backend.py", "AttentionBackend.supported_kv_cache_layouts"
                ),
            }
        impl = impl_class_name(cls)
        entry["impl"] = impl
        entry["kv_read"] = kv_reads(tree, impl, path)  # type: ignore[arg-type]
        entry["kv_read_helpers"] = kv_read_helpers(s, tree, impl, path)  # type: ignore[arg-type]
        entry["registered_tensor"] = registered_tensor(entry, enum, default_pref)
        out[key] = entry
    out.update(composite_backends(s, out, layout, BACKEND_FILES))
    return out


BHNC = ["num_blocks", "num_kv_heads", "block_size", "head_size + head_size_v"]


def registered_tensor(entry: dict[str, Any], enum: dict, default_pref: list) -> dict | None:
    """The per-layer tensor ``register_kv_caches`` gets, per layout: logical shape, the stride
    order (logical dims from outermost to innermost in memory) and the resulting physical shape."""
    out: dict[str, Any] = {}
    if enum:
        sup = (entry.get("supported_kv_cache_layouts") or {}).get("returns") or []
        firsts = []
        for r in sup:
            val = r.get("value")
            if isinstance(val, list) and val:
                firsts.append({"layout": val[0], "when": r.get("when")})
            elif val is None or "super()" in str(val):
                firsts.append({"layout": default_pref[0] if default_pref else None, "when": None})
        out["default_layout"] = firsts
        for layout in ("LBNHC", "LBHNC"):
            order = enum.get(layout, {}).get("layer_view_order_BHNC")
            if order is None:
                continue
            out[layout] = {
                "logical_shape": BHNC,
                "stride_order": order,
                "physical_shape": [BHNC[i] for i in order],
            }
        return out
    shape = entry.get("get_kv_cache_shape")
    if not shape:
        return None
    default = next((r for r in shape["returns"] if r["when"] is None), None)
    if default is None or not isinstance(default["dims"], list):
        return None
    dims = default["dims"]
    stride = entry.get("get_kv_cache_stride_order") or {}
    for layout in ("NHD", "HND"):
        order = stride.get(layout) if stride else list(range(len(dims)))
        if not isinstance(order, list) or len(order) != len(dims):
            out[layout] = {"logical_shape": dims, "stride_order": order}
            continue
        out[layout] = {
            "logical_shape": dims,
            "stride_order": order,
            "physical_shape": [dims[i] for i in order],
        }
    if not stride:
        out["note"] = "no get_kv_cache_stride_order: identity order, whatever the layout"
    return out
