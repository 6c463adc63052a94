"""Command-line flags that take a setting's values, parsed by the setting's own parser.

A flag such as ``bench --ratios`` or ``demo --ratio`` takes recompute ratios: its ``type`` is
:func:`setting_type`, so the range, the accepted forms and the error are the registry's (one line
naming the key, the flag's value and what is accepted), never a second check of its own::

    parser.add_argument("--ratio", type=setting_type("blend_recompute_ratios", "item"))
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from lmcache_backend.settings.registry import ENGINE
from lmcache_backend.settings.setting import ConfigError

#: where a flag's value comes from, as its errors say
COMMAND_LINE = "the command line"

Form = Literal["value", "item", "list"]


def parse_option(key: str, text: str, form: Form = "value") -> Any:
    """``text`` parsed as the engine key ``key``'s value (``value``), as one item of its list
    (``item``: one ratio of ``blend_recompute_ratios``), or as a comma-separated list of its
    values (``list``: several ``blend_selection`` values).

    Raises:
        ConfigError: ``text`` does not parse (names the key, the value and what is accepted).
    """
    setting = ENGINE[key]
    if form == "value":
        return setting.value(text, COMMAND_LINE)
    if form == "item":
        item = setting.parse.item
        if item is None:
            raise TypeError(f"{key} is not a list setting")
        return replace(setting, parse=item).value(text, COMMAND_LINE)
    words = [word.strip() for word in text.split(",")]
    if not all(words):
        raise setting.error(text, COMMAND_LINE, "expected one or more values separated by commas")
    return [setting.value(word, COMMAND_LINE) for word in words]


def setting_type(key: str, form: Form = "value") -> Callable[[str], Any]:
    """An argparse ``type`` parsing a flag's text as :func:`parse_option` does; a bad value is a
    usage error (argparse prints the flag and the setting's one-line error)."""

    def convert(text: str) -> Any:
        try:
            return parse_option(key, text, form)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = key  # argparse names the type in some messages
    return convert
