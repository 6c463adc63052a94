"""A release's sources (its slim zip, parsed with ``ast`` on demand) and helpers that find
definitions, parameters, class attributes and calls in the trees."""

from __future__ import annotations

import ast
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Sources:
    """The Python sources of one release (a slim zip), parsed on demand."""

    def __init__(self, slim: Path) -> None:
        self.zf = zipfile.ZipFile(slim)
        self.names = set(self.zf.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def artifact(self) -> dict[str, str]:
        return json.loads(self.zf.read("__artifact__.json"))

    def text(self, path: str) -> str | None:
        if path not in self.names:
            return None
        return self.zf.read(path).decode("utf-8-sig", errors="replace")

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            text = self.text(path)
            try:
                self._trees[path] = ast.parse(text) if text is not None else None
            except SyntaxError:  # a file of another Python version; not one we read
                self._trees[path] = None
        return self._trees[path]

    def glob(self, prefix: str, suffix: str = ".py") -> list[str]:
        return sorted(n for n in self.names if n.startswith(prefix) and n.endswith(suffix))


FuncDef = (ast.FunctionDef, ast.AsyncFunctionDef)


def find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def class_method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    for node in cls.body:
        if isinstance(node, FuncDef) and node.name == name:
            return node  # type: ignore[return-value]
    return None


def find_def(tree: ast.Module | None, qualname: str) -> ast.AST | None:
    """``func``, ``Class`` or ``Class.method`` at module level."""
    if tree is None:
        return None
    head, _, rest = qualname.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, *FuncDef)) and node.name == head:
            if not rest:
                return node
            if isinstance(node, ast.ClassDef):
                return class_method(node, rest)
    return None


def decorators(fn: ast.AST) -> list[str]:
    names = []
    for dec in getattr(fn, "decorator_list", []):
        target = dec.func if isinstance(dec, ast.Call) else dec
        names.append(ast.unparse(target).split(".")[-1])
    return names


def params(fn: ast.AST) -> list[str]:
    """Parameters as written (``name`` or ``name=default``, ``*args``, ``**kw``), without the
    leading ``self``/``cls`` of a method."""
    a = fn.args  # type: ignore[attr-defined]
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for arg, default in zip(positional, defaults):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if out and out[0] in ("self", "cls") and "staticmethod" not in decorators(fn):
        out = out[1:]
    if a.vararg:
        out.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        out.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.kwarg:
        out.append(f"**{a.kwarg.arg}")
    return out


def own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a function body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*FuncDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def call_name(call: ast.Call) -> str:
    return ast.unparse(call.func).split(".")[-1]


def class_attribute(tree: ast.Module | None, cls_name: str, attr: str, seen=()) -> str | None:
    """The class (of this file) declaring ``attr``: in its body, or ``self.<attr> = ...`` in one
    of its methods, following base classes defined in the same file."""
    cls = find_class(tree, cls_name)
    if cls is None or cls_name in seen:
        return None
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == attr:
            return cls_name
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == attr for t in node.targets):
            return cls_name
        if isinstance(node, FuncDef) and node.name == attr:
            return cls_name
    for node in ast.walk(cls):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr == attr:
                    if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        return cls_name
    for base in cls.bases:
        found = class_attribute(tree, ast.unparse(base).split(".")[-1], attr, (*seen, cls_name))
        if found:
            return found
    return None


def src(path: str, qualname: str) -> str:
    return f"{path}::{qualname}"


def enclosing_qualname(tree: ast.Module, target: ast.AST) -> str:
    for node in tree.body:
        if isinstance(node, FuncDef) and any(n is target for n in own_nodes(node)):
            return node.name
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, FuncDef) and any(n is target for n in own_nodes(fn)):
                    return f"{node.name}.{fn.name}"
    return "<module>"


def enclosing_tests(fn: ast.AST, target: ast.AST) -> list[str]:
    """The if-tests (``not (...)`` for else branches) on the path to ``target``."""

    def walk(body: list[ast.stmt], conds: list[str]) -> list[str] | None:
        for stmt in body:
            if stmt is target or any(n is target for n in ast.walk(stmt)):
                if isinstance(stmt, ast.If) and stmt is not target:
                    test = ast.unparse(stmt.test)
                    found = walk(stmt.body, [*conds, test])
                    if found is not None:
                        return found
                    found = walk(stmt.orelse, [*conds, f"not ({test})"])
                    if found is not None:
                        return found
                for attr in ("body", "orelse", "finalbody"):
                    sub = getattr(stmt, attr, None)
                    if isinstance(sub, list) and not isinstance(stmt, ast.If):
                        found = walk(sub, conds)
                        if found is not None:
                            return found
                return conds
        return None

    return walk(list(fn.body), []) or []  # type: ignore[attr-defined]


def function_by_qualname(tree: ast.Module, qual: str) -> ast.AST | None:
    return find_def(tree, qual)


def calls_in(s: Sources, paths: list[str], names: set[str]) -> list[dict[str, Any]]:
    """Calls to any of ``names`` in ``paths``, with their function and enclosing if-tests."""
    out = []
    for path in paths:
        tree = s.tree(path)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and call_name(node) in names:
                qual = enclosing_qualname(tree, node)
                fn = function_by_qualname(tree, qual)
                tests = enclosing_tests(fn, node) if fn is not None else []
                out.append(
                    {"call": ast.unparse(node), "source": src(path, qual), "when": tests or None}
                )
    return sorted(out, key=lambda d: (d["source"], d["call"]))
