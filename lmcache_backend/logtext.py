"""Values echoed in log lines and error messages, cut to a bounded length.

A value a client or a server supplies (a request's parameters, an error's text, a URL) can be
any length; a log line quoting it must not be (one request's million-item list would otherwise
add megabytes to the log), and rendering it must not cost time in proportion to its size.
"""

from __future__ import annotations

import reprlib
from typing import Any

#: longest echo of one value, in characters
MAX_SHOWN = 200

# renders the first items of a container and the ends of a long string only (``...`` between)
_REPR = reprlib.Repr()
_REPR.maxlevel = 4
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = 12
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = MAX_SHOWN


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)``, cut to about ``limit`` characters without rendering all of a huge
    value; a large container says how many items it has."""
    try:
        text = shorten(_REPR.repr(value), limit)
    except Exception:  # a repr that fails (an int past Python's digit limit): still a line
        text = f"<{type(value).__name__} that cannot be shown>"
    if isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) > _REPR.maxlist:
        text += f" ({type(value).__name__} of {len(value)} items)"
    return text
