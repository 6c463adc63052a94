"""Return statements with the if-tests that lead to them, and symbolic evaluation of small
functions (``get_kv_cache_shape``, ``get_kv_cache_stride_order``, layout getters)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from .sources import Sources, call_name, find_def, own_nodes, params, src


def returns(body: list[ast.stmt], conds: tuple[str, ...] = ()) -> Iterator[tuple]:
    """``(conditions, value)`` of every return statement in source order, with the if-tests
    enclosing it (``not (...)`` in an else branch). A return applies when its tests hold and no
    earlier one was taken; a branch that only raises is a validity check and is skipped."""
    for stmt in body:
        if isinstance(stmt, ast.Return):
            yield conds, stmt.value
            return
        if isinstance(stmt, ast.If) and stmt.body and isinstance(stmt.body[-1], ast.Raise):
            if not stmt.orelse:
                continue
        if isinstance(stmt, ast.If):
            test = ast.unparse(stmt.test)
            yield from returns(stmt.body, (*conds, test))
            yield from returns(stmt.orelse, (*conds, f"not ({test})"))
        elif isinstance(stmt, (ast.With, ast.For, ast.While)):
            yield from returns(stmt.body, conds)
        elif isinstance(stmt, ast.Try):
            yield from returns(stmt.body, conds)


def shape_dims(value: ast.AST | None, fn: ast.AST) -> list[str] | str | None:
    if value is None:
        return None
    if isinstance(value, ast.Name):  # a local assigned once from a tuple
        for node in own_nodes(fn):
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [
                value.id
            ]:
                value = node.value
                break
    if isinstance(value, ast.Tuple):
        return [ast.unparse(e) for e in value.elts]
    if isinstance(value, ast.Constant):
        return value.value
    return ast.unparse(value)


def returned_shapes(fn: ast.AST | None, s: Sources | None = None) -> list[dict[str, Any]]:
    """The shapes a function returns; ``X.get_kv_cache_shape(...)`` delegations are followed
    (one level) into ``vllm/attention/ops`` / ``vllm/v1/attention/ops``."""
    if fn is None:
        return []
    out = []
    for conds, value in returns(fn.body):  # type: ignore[attr-defined]
        entry: dict[str, Any] = {"dims": shape_dims(value, fn), "when": " and ".join(conds) or None}
        if s is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            owner = ast.unparse(value.func.value)
            for path in s.glob("vllm/attention/ops/") + s.glob("vllm/v1/attention/ops/"):
                target = find_def(s.tree(path), f"{owner}.{value.func.attr}")
                if target is not None:
                    entry["delegate"] = {
                        "returns": returned_shapes(target),
                        "source": src(path, f"{owner}.{value.func.attr}"),
                    }
                    break
        out.append(entry)
    return out


class Unknown(Exception):
    pass


def _eval(node: ast.AST, env: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_eval(e, env) for e in node.elts)
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise Unknown(node.id)
    if isinstance(node, ast.Call) and call_name(node) == "get_kv_cache_layout":
        return env["__layout__"]
    if isinstance(node, ast.BoolOp):
        vals = [_eval(v, env) for v in node.values]
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _eval(node.operand, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = _eval(node.left, env), _eval(node.comparators[0], env)
        op = node.ops[0]
        if isinstance(op, ast.Eq):
            return left == right
        if isinstance(op, ast.NotEq):
            return left != right
        if isinstance(op, ast.In):
            return left in right
        if isinstance(op, ast.Is):
            return left is right
        if isinstance(op, ast.IsNot):
            return left is not right
    raise Unknown(ast.unparse(node))


def _run(body: list[ast.stmt], env: dict[str, Any]) -> Any:
    for stmt in body:
        if isinstance(stmt, ast.Return):
            return ("return", _eval(stmt.value, env) if stmt.value else None)
        if isinstance(stmt, ast.Raise):
            return ("raise", None)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                try:
                    env[target.id] = _eval(stmt.value, env)
                except Unknown:
                    env.pop(target.id, None)
            continue
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if stmt.value is not None:
                try:
                    env[stmt.target.id] = _eval(stmt.value, env)
                except Unknown:
                    env.pop(stmt.target.id, None)
            continue
        if isinstance(stmt, ast.If):
            result = _run(stmt.body if _eval(stmt.test, env) else stmt.orelse, env)
            if result is not None:
                return result
            continue
        if isinstance(stmt, (ast.Expr, ast.Pass, ast.Global, ast.ImportFrom, ast.Import)):
            continue
        raise Unknown(ast.unparse(stmt)[:80])
    return None


def stride_orders(fn: ast.AST | None) -> dict[str, Any] | None:
    """get_kv_cache_stride_order evaluated for NHD/HND, with and without a layers dim."""
    if fn is None:
        return None
    names = params(fn)
    out: dict[str, Any] = {"params": names}
    cases = [("NHD", False), ("HND", False)]
    if any(p.startswith("include_num_layers_dimension") for p in names):
        cases += [("NHD", True), ("HND", True)]
    for layout, layers in cases:
        env = {"__layout__": layout, "include_num_layers_dimension": layers}
        try:
            result = _run(list(fn.body), env)  # type: ignore[attr-defined]
        except Unknown as exc:
            out[layout + ("_cross_layer" if layers else "")] = f"unevaluated: {exc}"
            continue
        kind, value = result if result else ("none", None)
        key = layout + ("_cross_layer" if layers else "")
        out[key] = list(value) if kind == "return" and isinstance(value, tuple) else kind
    return out


def layout_returns(fn: ast.AST | None) -> list[dict[str, Any]]:
    out = []
    if fn is None:
        return out
    for conds, value in returns(fn.body):  # type: ignore[attr-defined]
        if isinstance(value, ast.Tuple):
            val: Any = [ast.unparse(e).split(".")[-1] for e in value.elts]
        else:
            val = ast.unparse(value) if value is not None else None
        out.append({"value": val, "when": " and ".join(conds) or None})
    return out
