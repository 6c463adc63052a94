"""One parser per type of setting value, each saying what it accepts.

A parser turns a raw value (a YAML value, an environment variable's text, a JSON value from
``kv_connector_extra_config`` or ``kv_transfer_params``, or an already parsed value) into the
setting's value, or raises ``ValueError`` saying why. Parsing an already parsed value returns it
unchanged, so a value can be checked again wherever it arrives. :attr:`Parser.accepts` says in a
few words what the parser takes: errors and the generated docs show it;
:attr:`Parser.annotation` is the type of its values, which the settings objects' generated fields
declare (:mod:`lmcache_backend.settings.codegen`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: words every boolean setting takes (case and surrounding spaces ignored)
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
#: text an optional setting reads as "not set"
NONE_WORDS = ("", "none", "null")


@dataclass(frozen=True)
class Parser:
    """A raw value -> the setting's value (``ValueError``/``TypeError`` saying why not).

    Attributes:
        convert: the conversion.
        accepts: what it takes, e.g. ``"true or false"``, ``"an integer >= 1"``.
        choices: the values a choice takes (empty for other parsers).
        annotation: the type of its values as Python writes it (``"list[float]"``): the
            settings objects' fields are declared with it.
        item: the parser of each item, for a list parser (a command-line flag that takes one
            item parses it with this).
    """

    convert: Callable[[Any], Any]
    accepts: str
    choices: tuple[str, ...] = ()
    annotation: str = "Any"
    item: Parser | None = None

    def __call__(self, value: Any) -> Any:
        return self.convert(value)


def boolean() -> Parser:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case), a bool, or the integers 0/1."""

    def convert(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        text = value.strip().lower() if isinstance(value, str) else None
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
        raise ValueError(f"expected {accepts}")

    accepts = "true or false (yes/no, on/off, 1/0)"
    return Parser(convert, accepts, annotation="bool")


def _bounds(minimum: float | None, maximum: float | None, open_max: bool) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum:g}, {maximum:g}{')' if open_max else ']'}"
    if minimum is not None:
        return f" >= {minimum:g}"
    return ""


def _integral(value: Any) -> int:
    """An integer from an int, a whole float or decimal text; never from a bool."""
    if isinstance(value, bool):
        raise ValueError("expected an integer, not a boolean")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{value} is not an integer")
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    raise TypeError(f"expected an integer, not {type(value).__name__}")


def integer(minimum: int | None = None) -> Parser:
    """An integer (``>= minimum``)."""
    accepts = "an integer" + _bounds(minimum, None, False)

    def convert(value: Any) -> int:
        number = _integral(value)
        if minimum is not None and number < minimum:
            raise ValueError(f"expected {accepts}")
        return number

    return Parser(convert, accepts, annotation="int")


def _real(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    if isinstance(value, str):
        return float(value.strip())
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"expected a number, not {type(value).__name__}")


def number(
    minimum: float | None = None,
    maximum: float | None = None,
    above_minimum: bool = False,
    below_maximum: bool = False,
    unit: str = "",
) -> Parser:
    """A finite number in a range: ``minimum <= x`` (``<`` with ``above_minimum``), ``x <=
    maximum`` (``<`` with ``below_maximum``). NaN and infinities are refused."""
    if above_minimum:
        accepts = f"a number > {minimum:g}"
    else:
        accepts = "a number" + _bounds(minimum, maximum, below_maximum)
    if above_minimum and maximum is not None:
        accepts += f", <= {maximum:g}"
    accepts += f" {unit}" if unit else ""

    def convert(value: Any) -> float:
        x = _real(value)
        ok = math.isfinite(x)
        if ok and minimum is not None:
            ok = x > minimum if above_minimum else x >= minimum
        if ok and maximum is not None:
            ok = x < maximum if below_maximum else x <= maximum
        if not ok:
            raise ValueError(f"expected {accepts}")
        return x

    return Parser(convert, accepts, annotation="float")


def text(allow_empty: bool = True) -> Parser:
    """A string (no NUL character; non-empty unless ``allow_empty``)."""
    accepts = "text" if allow_empty else "non-empty text"

    def convert(value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected {accepts}, not {type(value).__name__}")
        if "\0" in value or not (allow_empty or value):
            raise ValueError(f"expected {accepts}")
        return value

    return Parser(convert, accepts, annotation="str")


def choice(*choices: str) -> Parser:
    """One of ``choices`` (case and surrounding spaces ignored: LMCache writes ``LRU``)."""
    accepts = "one of " + ", ".join(choices)

    def convert(value: Any) -> str:
        word = value.strip().lower() if isinstance(value, str) else None
        if word not in choices:
            raise ValueError(f"expected {accepts}")
        return word

    return Parser(convert, accepts, tuple(choices), annotation="str")


def optional(inner: Parser, accepts: str = "") -> Parser:
    """``inner``'s values, or None (``None``, ``""``, ``"none"``, ``"null"``); ``accepts``
    overrides what it says it takes."""

    def convert(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS):
            return None
        return inner(value)

    return Parser(
        convert,
        accepts or f"{inner.accepts}, or null",
        inner.choices,
        annotation=f"{inner.annotation} | None",
    )


def path() -> Parser:
    """A file or folder path (unset or empty: None)."""
    return optional(text(allow_empty=False), "a path")


def _items(value: Any) -> list:
    """A list's items: a YAML/JSON list, one number, or text ``a,b`` / ``[a, b]``."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        inner = value.strip().strip("[]")
        return [part.strip() for part in inner.split(",") if part.strip()]
    raise TypeError(f"expected a list, not {type(value).__name__}")


def number_list(item: Parser, what: str) -> Parser:
    """A non-empty list of ``item`` values (``what``: their name, e.g. ``ratio``)."""
    accepts = f"one or more {what}s, each {item.accepts} (0.1 or 0.3,0.15)"

    def convert(value: Any) -> list:
        items = _items(value)
        if not items:
            raise ValueError(f"at least one {what} is needed")
        out = []
        for raw in items:
            try:
                out.append(item(raw))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{what} {raw!r}: {exc}") from None
        return out

    return Parser(convert, accepts, annotation=f"list[{item.annotation}]", item=item)


def layer_list() -> Parser:
    """A non-empty, strictly increasing list of layer indices ``>= 0``."""
    layer = integer(minimum=0)
    accepts = "strictly increasing layer indices >= 0 (1 or 1,2)"

    def convert(value: Any) -> list[int]:
        items = _items(value)
        if not items:
            raise ValueError("at least one check layer is needed")
        try:
            layers = [layer(raw) for raw in items]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"layers must be integers >= 0 ({exc})") from None
        if sorted(set(layers)) != layers:
            raise ValueError("layers must be strictly increasing")
        return layers

    return Parser(convert, accepts, annotation="list[int]", item=layer)


def json_object() -> Parser:
    """A mapping: a YAML/JSON object, or its JSON text."""

    def convert(value: Any) -> dict:
        if value is None:
            return {}
        if isinstance(value, Mapping):
            return dict(value)
        if not isinstance(value, str):
            raise TypeError(f"expected a JSON object, not {type(value).__name__}")
        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError("expected a JSON object")
        return parsed

    return Parser(convert, "a JSON object", annotation="dict[str, Any]")


def count_or_auto() -> Parser:
    """``"auto"`` or an integer ``>= 0`` (a count of something per step)."""
    count = integer(minimum=0)
    accepts = "an integer >= 0 or 'auto'"

    def convert(value: Any) -> int | str:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return count(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected {accepts}") from None

    return Parser(convert, accepts, annotation="int | str")
