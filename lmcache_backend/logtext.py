"""Values echoed in log lines and error messages, cut to a bounded length.

A value a client or a server supplies (a request's parameters, an error's text, a URL) can be
any length; a log line quoting it must not be (one request's million-item list would otherwise
add megabytes to the log).
"""

from __future__ import annotations

from typing import Any

#: longest echo of one value, in characters
MAX_SHOWN = 200


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` cut to ``limit`` characters (a huge list is not rendered in full)."""
    if isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        head = list(value)[:limit] if not isinstance(value, dict) else list(value.items())[:limit]
        return shorten(repr(head), limit) + f" ({type(value).__name__} of {len(value)} items)"
    return shorten(repr(value), limit)
