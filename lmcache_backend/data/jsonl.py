"""JSON Lines files, read the one way every reader here wants: blank lines skipped, each other
line one JSON value, and every fault one line naming the file and the line number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmcache_backend.logtext import shorten


def read_jsonl(path: str | Path, error: type[Exception]) -> Iterator[tuple[str, int, Any]]:
    """``(where, number, value)`` per non-blank line of ``path``: ``where`` is ``file:number``
    for the caller's own messages, ``value`` the parsed line.

    Raises:
        error: the file cannot be opened, or a line is not JSON (one line naming both).
    """
    name = shorten(str(path))
    try:
        handle = Path(path).open(encoding="utf-8")
    except OSError as exc:
        raise error(f"{name}: cannot open it ({exc.strerror})") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{name}:{number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: not JSON ({exc.msg})") from None
            yield where, number, value
