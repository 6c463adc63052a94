"""vLLM ``connector_api``: ``KVConnectorBase_V1`` (methods, abstract methods, class attributes,
roles) and how ``KVConnectorFactory`` loads and constructs a connector."""

from __future__ import annotations

import ast
from typing import Any

from .sources import FuncDef, Sources, class_method, decorators, find_class, own_nodes, params, src

CONNECTOR_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"

FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"


def method_table(cls: ast.ClassDef) -> dict[str, Any]:
    out = {}
    for node in cls.body:
        if isinstance(node, FuncDef):
            decos = [d for d in decorators(node) if d != "override"]
            entry: dict[str, Any] = {"params": params(node)}
            if decos:
                entry["decorators"] = decos
            out[node.name] = entry
    return out


def connector_api(s: Sources) -> dict[str, Any]:
    tree = s.tree(CONNECTOR_BASE)
    cls = find_class(tree, "KVConnectorBase_V1")
    if cls is None:
        return {"source": CONNECTOR_BASE, "missing": True}
    methods = method_table(cls)
    role = find_class(tree, "KVConnectorRole")
    roles = (
        [ast.unparse(n.targets[0]) for n in role.body if isinstance(n, ast.Assign)] if role else []
    )
    other_abstract = {}
    for node in tree.body:  # type: ignore[union-attr]
        if isinstance(node, ast.ClassDef) and node.name != "KVConnectorBase_V1":
            abstract = [
                f.name
                for f in node.body
                if isinstance(f, FuncDef) and "abstractmethod" in decorators(f)
            ]
            if abstract:
                other_abstract[node.name] = {
                    m: params(class_method(node, m))
                    for m in abstract  # type: ignore[arg-type]
                }
    class_attrs = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            value = ast.unparse(node.value) if node.value is not None else None
            class_attrs[ast.unparse(node.target)] = f"{ast.unparse(node.annotation)} = {value}"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                class_attrs[ast.unparse(target)] = ast.unparse(node.value)
    return {
        "source": src(CONNECTOR_BASE, "KVConnectorBase_V1"),
        "bases": [ast.unparse(b) for b in cls.bases],
        "class_attributes": class_attrs,
        "methods": methods,
        "abstract": sorted(
            m for m, e in methods.items() if "abstractmethod" in e.get("decorators", [])
        ),
        "roles": roles,
        "roles_source": src(CONNECTOR_BASE, "KVConnectorRole"),
        "other_abstract_classes": other_abstract,
        "factory": connector_factory(s),
    }


def connector_factory(s: Sources) -> dict[str, Any]:
    tree = s.tree(FACTORY)
    cls = find_class(tree, "KVConnectorFactory")
    if cls is None:
        return {"source": FACTORY, "missing": True}
    out: dict[str, Any] = {"source": src(FACTORY, "KVConnectorFactory")}
    loaders = []
    for fn in cls.body:
        if not isinstance(fn, FuncDef):
            continue
        text = ast.unparse(fn)
        if "kv_connector_module_path" in text:
            loaders.append(src(FACTORY, f"KVConnectorFactory.{fn.name}"))
            for node in own_nodes(fn):
                if isinstance(node, ast.If) and "supports_kw" in ast.unparse(node.test):
                    body = ast.unparse(node)
                    out["kv_cache_config_check"] = {
                        "test": ast.unparse(node.test),
                        "action": "raise" if "raise " in body else "warn (2-argument constructor)",
                        "source": src(FACTORY, f"KVConnectorFactory.{fn.name}"),
                    }
        if fn.name.startswith("create_connector"):
            out["create_connector"] = src(FACTORY, f"KVConnectorFactory.{fn.name}")
            out["create_connector_params"] = params(fn)
            out["instantiation"] = sorted(
                {
                    ast.unparse(n)
                    for n in own_nodes(fn)
                    if isinstance(n, ast.Call) and ast.unparse(n.func) == "connector_cls"
                }
            )
            hma = [
                ast.unparse(n.test)
                for n in own_nodes(fn)
                if isinstance(n, ast.If) and "hma" in ast.unparse(n.test)
            ]
            if hma:
                out["hma_check"] = {"test": hma[0], "action": "raise"}
    out["module_path_loaders"] = loaders
    return out
