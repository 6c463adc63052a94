"""Writing the fixtures: deterministic JSON (sorted keys, 2-space indent, a list or object that
fits on its line written on one line) and ``index.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .releases import SCHEMA, dist_name, vkey


def fixture_name(package: str, version: str) -> str:
    return f"{dist_name(package)}-{version}.json"


def dumps(data: Any, indent: int = 0, used: int = 0, width: int = 100) -> str:
    """JSON with sorted keys and 2-space indentation; a list or object that fits on its line
    (``used`` columns are taken already) within ``width`` columns is written on one line."""
    one = json.dumps(data, sort_keys=True, separators=(", ", ": "))
    if not isinstance(data, (dict, list)) or not data or used + len(one) <= width:
        return one
    pad = " " * (indent + 2)
    if isinstance(data, list):
        items = [pad + dumps(v, indent + 2, indent + 2, width) for v in data]
    else:
        items = []
        for key in sorted(data):
            head = pad + json.dumps(key) + ": "
            items.append(head + dumps(data[key], indent + 2, len(head), width))
    close = "]" if isinstance(data, list) else "}"
    return (
        ("[" if isinstance(data, list) else "{")
        + "\n"
        + ",\n".join(items)
        + "\n"
        + " " * indent
        + close
    )


def write_json(path: Path, data: Any) -> None:
    text = dumps(data) + "\n"
    assert json.loads(text) == json.loads(json.dumps(data))
    path.write_text(text)


def write_index(out: Path) -> None:
    """``index.json``: every fixture in ``out`` with its package, version and artifact."""
    entries = []
    for path in sorted(out.glob("*.json")):
        if path.name == "index.json":
            continue
        data = json.loads(path.read_text())
        entries.append(
            {
                "package": data["package"],
                "version": data["version"],
                "file": path.name,
                "artifact": data["artifact"]["artifact"],
            }
        )
    entries.sort(key=lambda e: (e["package"], vkey(e["version"])))
    write_json(out / "index.json", {"schema": SCHEMA, "fixtures": entries})
