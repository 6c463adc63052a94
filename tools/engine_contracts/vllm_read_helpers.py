"""Reads of a backend's ``kv_cache`` through a helper function (``k, v = Helper.split(kv_cache,
...)``) rather than a ``kv_cache.<op>`` chain, with the if-tests that choose them and the
environment variables those tests come from.

vLLM 0.9.2-0.10.2's ``TritonAttentionImpl`` is the case in point: under
``VLLM_V1_USE_PREFILL_DECODE_ATTENTION`` it views the same cache through
``PagedAttention.split_kv_cache`` (K ``[NB, H, D/x, BS, x]``, V ``[NB, H, D, BS]``), another
element order than its default ``kv_cache.unbind(0)``.
"""

from __future__ import annotations

import ast
from typing import Any

from .sources import (
    FuncDef,
    Sources,
    class_method,
    enclosing_tests,
    find_class,
    find_def,
    own_nodes,
    src,
)

ENVS = "vllm/envs.py"
HELPER_DIRS = ("vllm/attention/ops/", "vllm/v1/attention/ops/")


def _passes_kv_cache(call: ast.Call) -> bool:
    """``F(kv_cache, ...)`` where ``F`` is not a method of ``kv_cache`` itself."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        if func.value.id == "kv_cache":
            return False
    return any(isinstance(a, ast.Name) and a.id == "kv_cache" for a in call.args)


def _assignments(scope: ast.AST, target: str) -> list[ast.expr]:
    """Values assigned to ``target`` (a name or ``self.attr``) anywhere in ``scope``."""
    found = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            if any(ast.unparse(t) == target for t in node.targets):
                found.append(node.value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            if ast.unparse(node.target) == target:
                found.append(node.value)
    return found


def env_switches(tests: list[str], fn: ast.AST, cls: ast.ClassDef) -> list[str]:
    """The ``envs.NAME`` variables the if-tests come from: local names are followed to their
    assignments in ``fn``, ``self.attr`` to its assignments in ``cls``."""
    names: list[str] = []
    seen: set[str] = set()
    pending: list[ast.expr] = [ast.parse(t, mode="eval").body for t in tests]
    while pending:
        expr = pending.pop()
        for node in ast.walk(expr):
            text = ast.unparse(node)
            if text in seen:
                continue
            seen.add(text)
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "envs":
                if node.attr not in names:
                    names.append(node.attr)
            elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self":
                pending.extend(_assignments(cls, text))
            elif isinstance(node, ast.Name):
                pending.extend(_assignments(fn, node.id))
    return sorted(names)


def env_definition(s: Sources, name: str) -> dict[str, Any] | None:
    """How ``vllm/envs.py`` reads ``name`` (its ``environment_variables`` lambda)."""
    tree = s.tree(ENVS)
    if tree is None:
        return None
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, val in zip(value.keys, value.values):
            if isinstance(key, ast.Constant) and key.value == name:
                body = val.body if isinstance(val, ast.Lambda) else val
                return {
                    "env": name,
                    "reads": ast.unparse(body),
                    "source": src(ENVS, "environment_variables"),
                }
    return None


def _body(fn: ast.AST, path: str, qual: str) -> dict[str, Any]:
    args = fn.args  # type: ignore[attr-defined]
    body = [
        st
        for st in fn.body  # type: ignore[attr-defined]
        if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))  # docstring
    ]
    names = [a.arg for a in [*args.posonlyargs, *args.args]]
    return {
        "params": [n for n in names if n not in ("self", "cls")],
        "body": [ast.unparse(st) for st in body],
        "source": src(path, qual),
    }


def _helper(s: Sources, call: ast.Call, cls: ast.ClassDef, path: str) -> dict[str, Any] | None:
    """The helper's parameters and body: a method of the implementation (``self.m``) or
    ``Owner.method`` in the attention ops."""
    if not isinstance(call.func, ast.Attribute):
        return None
    owner = ast.unparse(call.func.value)
    if owner == "self":
        fn = class_method(cls, call.func.attr)
        return None if fn is None else _body(fn, path, f"{cls.name}.{call.func.attr}")
    qual = f"{owner}.{call.func.attr}"
    for ops_path in [p for d in HELPER_DIRS for p in s.glob(d)]:
        fn = find_def(s.tree(ops_path), qual)
        if fn is not None:
            return _body(fn, ops_path, qual)
    return None


def kv_read_helpers(
    s: Sources, tree: ast.Module, impl_name: str | None, path: str
) -> list[dict[str, Any]]:
    """``k, v = F(kv_cache, ...)`` reads of the implementation: the code, its if-tests
    (``when``), the environment variables behind them (``switches``) and the helper's body."""
    cls = find_class(tree, impl_name) if impl_name else None
    if cls is None:
        return []
    found: list[tuple[int, dict[str, Any]]] = []
    for fn in cls.body:
        if not isinstance(fn, FuncDef):
            continue
        for node in own_nodes(fn):
            if not (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Call)
                and _passes_kv_cache(node.value)
            ):
                continue
            tests = enclosing_tests(fn, node)
            switches = [env_definition(s, n) for n in env_switches(tests, fn, cls)]
            entry = {
                "code": ast.unparse(node),
                "when": " and ".join(tests) or None,
                "switches": [d for d in switches if d is not None],
                "helper": _helper(s, node.value, cls, path),
                "source": src(path, f"{cls.name}.{fn.name}"),
            }
            found.append((node.lineno, entry))
    return [entry for _, entry in sorted(found, key=lambda f: f[0])]
