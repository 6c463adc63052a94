"""Check a family's declared LMCache symbols against LMCache source code, without importing it.

``check(root, family)`` parses the modules under ``root`` (a folder holding the ``lmcache``
package: an unpacked release wheel, or ``site-packages``) and reports every declared symbol
that is missing or has a different signature. Only the standard library's ``ast`` is used, so a
CUDA build of LMCache can be checked on any machine.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from lmcache_backend.compat.lmcache import Kind, LMCacheFamily, Symbol


@functools.lru_cache(maxsize=256)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def module_path(root: Path, module: str) -> Path | None:
    """The source file of dotted ``module`` under ``root``, or None."""
    base = Path(root, *module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _bound_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound at the top of ``body``: defs, classes, assignments and imports."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes assigned as ``self.<name> = ...`` in any method of ``cls``."""
    out: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                out.add(target.attr)
    return out


def signature_of(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> tuple[str, ...]:
    """Parameter names (positional, then keyword-only), without ``self``/``cls``."""
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args]
    is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if method and not is_static and names:
        names = names[1:]
    return tuple(names + [a.arg for a in args.kwonlyargs])


def find(root: Path, sym: Symbol) -> tuple[ast.AST | None, str]:
    """The AST node of ``sym`` (or None) and, when None, why."""
    path = module_path(root, sym.module)
    if path is None:
        return None, f"module {sym.module} is missing"
    tree = _parse(path)
    if sym.kind is Kind.CONFIG_KEY:
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == sym.qualname for k in node.keys
            ):
                return node, ""
        return None, f"config key {sym.qualname!r} is not defined in {sym.module}"
    if sym.kind is Kind.CALL:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == sym.qualname:
                return node, ""
        return None, f"{sym.module} never calls {sym.qualname}"
    scope = _bound_names(tree.body)
    cls: ast.ClassDef | None = None
    if sym.owner:
        owner = scope.get(sym.owner)
        if not isinstance(owner, ast.ClassDef):
            return None, f"class {sym.owner} is not defined in {sym.module}"
        cls = owner
        scope = _bound_names(cls.body)
    if sym.kind is Kind.ATTR:
        if cls is not None and (sym.attr in scope or sym.attr in _self_attributes(cls)):
            return cls, ""
        return None, f"{sym.qualname} is never assigned in {sym.module}"
    node = scope.get(sym.attr)
    if node is None:
        return None, f"{sym.qualname} is not defined in {sym.module}"
    if sym.kind is Kind.CLASS and not isinstance(node, ast.ClassDef):
        return None, f"{sym.qualname} is not a class"
    if sym.kind is Kind.DEF and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None, f"{sym.qualname} is not a function"
    return node, ""


def check_symbol(root: Path, sym: Symbol) -> str | None:
    """None when ``sym`` matches the source under ``root``, else what differs."""
    node, why = find(root, sym)
    if node is None:
        return why
    if sym.kind is Kind.DEF:
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        params = signature_of(node, method=sym.owner is not None)
        if sym.params is not None and params != sym.params:
            return f"{sym.qualname} takes {params}, the glue expects {sym.params}"
        if sym.var_keyword and node.args.kwarg is None:
            return f"{sym.qualname} takes no **kwargs"
    if sym.kind is Kind.CALL and sym.nargs is not None:
        calls = [
            n
            for n in ast.walk(_parse(module_path(root, sym.module)))  # type: ignore[arg-type]
            if isinstance(n, ast.Call) and ast.unparse(n.func) == sym.qualname
        ]
        counts = sorted({len(c.args) for c in calls})
        if counts != [sym.nargs]:
            return f"{sym.module} calls {sym.qualname} with {counts} arguments, not {sym.nargs}"
    return None


def check(root: Path, family: LMCacheFamily) -> list[str]:
    """Every mismatch between ``family``'s symbols and the source under ``root``."""
    problems = []
    for sym in family.symbols:
        why = check_symbol(Path(root), sym)
        if why is not None:
            problems.append(f"[{sym.key}] {why}")
    return problems


def dataclass_fields(root: Path, module: str, cls: str) -> tuple[str, ...]:
    """Annotated class-level fields of ``cls`` in order (a dataclass's fields)."""
    path = module_path(Path(root), module)
    if path is None:
        return ()
    node = _bound_names(_parse(path).body).get(cls)
    if not isinstance(node, ast.ClassDef):
        return ()
    return tuple(
        n.target.id
        for n in node.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    )
