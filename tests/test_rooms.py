"""The package's rooms and the way imports run between them, as ``docs/architecture.md`` draws
them: its folder table lists every room (a top-level folder or module of the package, with
``backends/`` and ``patches/``), top to bottom; an import points down the table or stays in its
row, never back up; no two rooms import each other, directly or through others; and no folder of
the package holds more than ``MAX_MODULES`` modules.

Every import counts, wherever it stands: at the top of a module, inside a function, under
``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

PACKAGE = "lmcache_backend"
#: where each installed package's sources live in the checkout
SOURCES = {
    PACKAGE: REPO_ROOT / PACKAGE,
    f"{PACKAGE}.backends": REPO_ROOT / "backends",
    f"{PACKAGE}.patches": REPO_ROOT / "patches",
}
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
#: a folder with more modules than this is split into sub-packages (``__init__.py`` not counted)
MAX_MODULES = 15


def table_rows(text: str) -> list[list[str]]:
    """The rooms of each row of the folder table (``## Folders``), top to bottom: the names in
    backticks of a row's first cell that end in ``/`` or ``.py`` (``settings/`` -> ``settings``,
    ``config.py`` -> ``config``, ``__init__.py`` -> ``__init__``)."""
    section = text.split("## Folders", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("folder", "") or set(cells[0]) <= set("-"):
            continue
        names = re.findall(r"`([\w.]+/|[\w.]+\.py)`", cells[0])
        rows.append([n.removesuffix("/").removesuffix(".py") for n in names])
    return rows


def room_of(module: str) -> str:
    """``lmcache_backend.blend.blender`` -> ``blend``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for prefix, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


def imported(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(module imported, line)`` of every import of the package in one module;
    ``from P import name`` counts as importing ``P.name`` where that is a module."""
    found = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((name if name in modules else base, node.lineno))
    ours = {(m, line) for m, line in found if m == PACKAGE or m.startswith(PACKAGE + ".")}
    return sorted(ours, key=lambda found: (found[1], found[0]))


def room_imports() -> dict[tuple[str, str], list[str]]:
    """``(room, room it imports) -> ["file:line imports module", ...]``, between rooms only."""
    modules = package_modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in modules.items():
        for target, line in imported(module, path, modules):
            a, b = room_of(module), room_of(target)
            if a != b:
                where = f"{path.relative_to(REPO_ROOT)}:{line} imports {target}"
                edges.setdefault((a, b), []).append(where)
    return edges


def package_rooms() -> set[str]:
    rooms = {"backends", "patches"}
    for path in (REPO_ROOT / PACKAGE).iterdir():
        if path.suffix == ".py" or (path / "__init__.py").is_file():
            rooms.add(path.stem)
    return rooms


def upward(rows: list[list[str]], edges) -> list[str]:
    """The imports that point back up the table."""
    row = {room: i for i, names in enumerate(rows) for room in names}
    return [w for (a, b), where in edges.items() if row[b] < row[a] for w in where]


def cycles(edges) -> list[list[str]]:
    """The room cycles (each as the rooms along it), found by depth-first search."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, done = [], set()

    def visit(room: str, trail: list[str]) -> None:
        if room in trail:
            found.append(trail[trail.index(room) :] + [room])
            return
        if room in done:
            return
        for nxt in sorted(graph.get(room, ())):
            visit(nxt, trail + [room])
        done.add(room)

    for room in sorted(graph):
        visit(room, [])
    return found


def test_the_folder_table_lists_every_room_once() -> None:
    rows = table_rows(ARCHITECTURE.read_text(encoding="utf-8"))
    listed = [room for names in rows for room in names]
    assert len(listed) == len(set(listed)), f"a room in two rows: {listed}"
    assert set(listed) == package_rooms(), (
        f"not in docs/architecture.md's folder table: {sorted(package_rooms() - set(listed))}; "
        f"listed but not in the package: {sorted(set(listed) - package_rooms())}"
    )


def test_imports_point_down_the_folder_table() -> None:
    rows = table_rows(ARCHITECTURE.read_text(encoding="utf-8"))
    assert upward(rows, room_imports()) == []


def test_no_two_rooms_import_each_other() -> None:
    assert cycles(room_imports()) == []


def test_no_folder_is_crowded() -> None:
    crowded = {}
    for root in SOURCES.values():
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > MAX_MODULES:
                crowded[str(folder.relative_to(REPO_ROOT))] = len(modules)
    assert crowded == {}, f"split these into sub-packages: {crowded}"


# The checks themselves, on made-up tables and graphs: each finds what it is there to find.


def test_an_import_up_the_table_and_a_loop_are_found() -> None:
    rows = [["cli"], ["bench", "demos"], ["blend"]]
    edges = {("cli", "blend"): ["down"], ("bench", "demos"): ["sideways"]}
    assert upward(rows, edges) == [] and cycles(edges) == []
    edges[("blend", "bench")] = ["blend/x.py:1 imports lmcache_backend.bench.y"]
    assert upward(rows, edges) == ["blend/x.py:1 imports lmcache_backend.bench.y"]
    edges[("demos", "bench")] = ["back"]
    assert ["bench", "demos", "bench"] in cycles(edges)


def test_the_table_is_read_from_its_first_column() -> None:
    text = (
        "## Folders\n\n| folder | holds |\n|---|---|\n"
        "| `cli.py`, `commands/` | the `lmcache-backend` command (`bench/` is below) |\n"
        "| `backends/` (installed as `lmcache_backend.backends`) | kernels |\n\n## Next\n"
        "| `ignored/` | after the section |\n"
    )
    assert table_rows(text) == [["cli", "commands"], ["backends"]]


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("from lmcache_backend import bench", "lmcache_backend.bench"),
        ("from lmcache_backend import BlendConfig", "lmcache_backend"),
        ("from lmcache_backend.blend.segmenting import X", "lmcache_backend.blend.segmenting"),
        ("import lmcache_backend.storage.tier", "lmcache_backend.storage.tier"),
        ("from . import rope", "lmcache_backend.backends.cuda.rope"),
    ],
)
def test_imports_are_resolved_to_modules(tmp_path: Path, statement: str, expected: str) -> None:
    path = tmp_path / "__init__.py"
    path.write_text(f"def f():\n    {statement}\n", encoding="utf-8")
    modules = package_modules()
    found = imported("lmcache_backend.backends.cuda", path, modules)
    assert found == [(expected, 2)]
