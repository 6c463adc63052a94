"""Feature probing: check a code path's symbols against an installed vLLM's source, unimported.

The gate uses this for a vLLM release it has no record of (one between two code paths, or an
untested one run with ``allow_untested_versions``): the sources are parsed with ``ast``, so the
check has none of importing vLLM's side effects. The rules are those the recorded contracts were
checked with: a function's leading parameters, an attribute assigned in the class (or a base class
of the same file), a class or function defined at module level.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from lmcache_backend.compat.profile import VllmProfile
from lmcache_backend.compat.symbols import Symbol


class SourceTree:
    """Python files under ``root`` (the folder holding the ``vllm`` package), parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        """The parsed file ``path`` (``vllm/...py``); KeyError when it does not exist."""
        if path not in self.trees:
            try:
                text = (self.root / path).read_text(encoding="utf-8")
            except FileNotFoundError:
                raise KeyError(path) from None
            self.trees[path] = ast.parse(text)
        return self.trees[path]

    def node(self, path: str, name: str) -> ast.AST | None:
        """A module-level class, function or assigned name of ``path``."""
        for n in self.tree(path).body:
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name:
                return n
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return n
        return None

    def classes(self, path: str, name: str) -> list[ast.ClassDef]:
        """The class and its bases defined in the same file, nearest first."""
        cls = self.node(path, name)
        out: list[ast.ClassDef] = []
        while isinstance(cls, ast.ClassDef) and cls not in out:
            out.append(cls)
            bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
            found = [self.node(path, b) for b in bases]
            cls = next((c for c in found if isinstance(c, ast.ClassDef)), None)
        return out


def _params(fn: ast.FunctionDef) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    return [n for n in names if n not in ("self", "cls")]


def _has_attribute(cls: ast.ClassDef, attr: str) -> bool:
    for n in ast.walk(cls):
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == attr:
            return True
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
                return True
        if isinstance(n, ast.FunctionDef) and n.name == attr:  # a property
            return True
    return False


def check_symbol(src: SourceTree, sym: Symbol) -> str | None:
    """None when ``sym`` exists as declared, else what is wrong, in words."""
    try:
        src.tree(sym.path)
    except KeyError:
        return f"{sym.path} is missing"
    head, _, member = sym.qualname.partition(".")
    if not member:
        node = src.node(sym.path, head)
        if node is None:
            return f"{sym.qualname} not found in {sym.path}"
        if sym.kind == "function" and sym.params and isinstance(node, ast.FunctionDef):
            got = _params(node)
            if got[: len(sym.params)] != list(sym.params):
                return f"{sym.qualname}{tuple(got)} lacks {sym.params}"
        return None
    chain = src.classes(sym.path, head)
    if not chain:
        return f"class {head} not found in {sym.path}"
    if sym.kind == "attribute":
        ok = any(_has_attribute(c, member) for c in chain)
        return None if ok else f"{sym.qualname} is not set in {sym.path}"
    for cls in chain:
        for n in cls.body:
            if isinstance(n, ast.FunctionDef) and n.name == member:
                got = _params(n)
                if got[: len(sym.params)] != list(sym.params):
                    return f"{sym.qualname}{tuple(got)} does not start with {sym.params}"
                return None
    return f"method {sym.qualname} not found in {sym.path}"


def missing_symbols(profile: VllmProfile, src: SourceTree) -> list[str]:
    """What the installed source lacks of ``profile``'s code path (empty: it has everything)."""
    return [p for s in profile.required_symbols() if (p := check_symbol(src, s))]


def installed_vllm_source() -> SourceTree | None:
    """The installed vLLM's sources, located without importing vLLM; None when not installed."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return SourceTree(package_dir.parent)
