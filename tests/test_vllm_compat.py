"""The version table against real vLLM releases, read from their published wheels (no install).

For each release with a code path, every symbol :meth:`VllmProfile.required_symbols` lists must
exist in that release's source with the expected parameters. Wheels are cached under
``<repo>/.cache/vllm-wheels/``; without network access and without a cached wheel the release is
skipped with the reason.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lmcache_backend.compat import UnsupportedVersions, check_supported
from lmcache_backend.compat.vllm import PROFILES, Symbol, profile_for

WHEELS = Path(__file__).resolve().parent.parent / ".cache" / "vllm-wheels"
OLD_RELEASES = ("0.9.2", "0.10.0", "0.11.0")


def _wheel(version: str) -> Path:
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux1_x86_64", "--platform",
           "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "-q", "-d",
           str(WHEELS), f"vllm=={version}"]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"vllm=={version} wheel unreachable: {exc}")
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        pytest.skip(f"no vllm=={version} wheel for this platform")
    return found[0]


class _Source:
    """Parsed files of one release, with class lookup through same-file base classes."""

    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse(self.zip.read(path).decode())
        return self.trees[path]

    def node(self, path: str, name: str) -> ast.AST | None:
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
            nxt = [self.node(path, b) for b in bases]
            cls = next((c for c in nxt if isinstance(c, ast.ClassDef)), None)
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
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == attr:
                    return True
        if isinstance(n, ast.FunctionDef) and n.name == attr:  # property
            return True
    return False


def check_symbol(src: _Source, sym: Symbol) -> str | None:
    """None when ``sym`` exists as declared, else what is wrong."""
    try:
        src.tree(sym.path)
    except KeyError:
        return f"{sym.path} is missing"
    head, _, member = sym.qualname.partition(".")
    if not member:
        node = src.node(sym.path, head)
        if node is None:
            return f"{sym.qualname} not found in {sym.path}"
        if sym.kind == "function" and sym.params:
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


@pytest.mark.parametrize("version", OLD_RELEASES)
def test_release_source_has_every_symbol_the_code_path_uses(version: str) -> None:
    src = _Source(_wheel(version))
    profile = PROFILES[version]
    problems = [p for s in profile.required_symbols() if (p := check_symbol(src, s))]
    assert not problems, f"vLLM {version}:\n" + "\n".join(problems)


def test_checker_rejects_a_wrong_signature() -> None:
    """The checker can fail: the 0.32 constructor (with kv_cache_config) is absent in 0.9.2."""
    src = _Source(_wheel("0.9.2"))
    wrong = [s for s in PROFILES["0.32.0"].required_symbols() if s.qualname.endswith("__init__")]
    assert wrong and check_symbol(src, wrong[0]) is not None


def test_installed_release_has_every_symbol() -> None:
    """The same table against the installed vLLM's own files (0.32.0 on CPU)."""
    vllm = pytest.importorskip("vllm")
    root = Path(vllm.__file__).resolve().parent.parent
    profile = profile_for(vllm.__version__)
    assert profile is not None, f"no code path for installed vLLM {vllm.__version__}"

    class _Installed(_Source):
        def __init__(self) -> None:
            self.trees = {}

        def tree(self, path: str) -> ast.Module:
            if path not in self.trees:
                try:
                    self.trees[path] = ast.parse((root / path).read_text())
                except FileNotFoundError:
                    raise KeyError(path) from None
            return self.trees[path]

    src = _Installed()
    problems = [p for s in profile.required_symbols() if (p := check_symbol(src, s))]
    assert not problems, "\n".join(problems)


def test_unknown_release_fails_with_the_matrix() -> None:
    with pytest.raises(UnsupportedVersions, match="0.32.0"):
        check_supported("0.5.0", None)
