"""How the ``lmcache-backend`` commands report a user's mistake: one line naming what is wrong
and what is accepted, exit status 2, no traceback (``lmcache-backend -v COMMAND`` adds it).

A mistake is a :class:`UsageError` (a bad argument, a missing file), a
:class:`~lmcache_backend.config.ConfigError` (a bad ``LMCACHE_*`` value), an invalid version
string, or an optional package that is not installed (the line names the extra that brings it).
Anything else is a defect and keeps its traceback.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from typing import TextIO

from packaging.version import InvalidVersion

from lmcache_backend.config import ConfigError

#: Exit status of a command stopped by a user's mistake (argparse's, for a bad argument).
USAGE_EXIT = 2

#: The longest error line printed; a longer message (a value pasted by mistake) is cut.
MAX_LINE = 400

#: Optional modules and the extra of this package that installs them.
EXTRA_OF_MODULE = {
    "transformers": "hf",
    "gguf": "hf",
    "accelerate": "hf",
    "triton": "cuda",
    "torch_npu": "ascend",
    "vllm_ascend": "ascend",
    "matplotlib": "bench",
    "langchain_core": "clients",
    "langchain_openai": "clients",
    "langchain_classic": "clients",
    "llama_index": "clients",
}


class UsageError(Exception):
    """A user's mistake; the message is the one line printed (name the argument or file, its
    value and what is accepted)."""


def one_line(message: str) -> str:
    """``message`` as one bounded line (its first line, cut at :data:`MAX_LINE` characters)."""
    lines = str(message).strip().splitlines() or [""]
    line = lines[0]
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


def _installed(top: str) -> bool:
    if sys.modules.get(top, False) is None:  # an import of it was blocked
        return False
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def missing_module_hint(name: str | None) -> str | None:
    """What installs the optional module ``name`` (``llama_index.core`` counts as
    ``llama_index``); None for a module that is not optional here, or whose package is
    installed (a missing submodule of an installed package is a defect or a version mismatch,
    and keeps its traceback)."""
    top = (name or "").split(".", 1)[0]
    if not top or _installed(top):
        return None
    if top == "vllm":
        return (
            "vLLM is not installed: install this package with the extra of your platform, "
            "[cuda], [cpu] or [ascend] (README, Install)"
        )
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return (
        f"the Python package {top} is not installed: it comes with this package's [{extra}] "
        f"extra (in a checkout: pip install -e '.[{extra}]')"
    )


def user_error_line(exc: BaseException) -> str | None:
    """The line to print for ``exc`` when it is a user's mistake, else None."""
    if isinstance(exc, (UsageError, ConfigError, InvalidVersion)):
        return one_line(str(exc))
    if isinstance(exc, ModuleNotFoundError):
        return missing_module_hint(exc.name)
    return None


def report(command: str, exc: BaseException, verbose: bool, out: TextIO | None = None) -> bool:
    """Print ``exc`` as ``lmcache-backend COMMAND: message`` when it is a user's mistake (with
    the traceback first when ``verbose``); False, printing nothing, for any other exception."""
    line = user_error_line(exc)
    if line is None:
        return False
    out = out or sys.stderr
    if verbose:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=out)
    print(f"lmcache-backend {command}: {line}", file=out)
    return True
