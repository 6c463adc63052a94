"""The typed fields of the settings objects, generated from the settings registry.

A block of generated declarations lives between two markers in a Python file::

    # <settings-fields: dataclass engine>
    #: master switch for CacheBlend
    enable_blending: bool = setting_field(ENGINE["enable_blending"])
    # </settings-fields>

The spec after ``settings-fields:`` names the form, the scopes and, optionally, the settings left
out (``except name,name``):

* ``dataclass``: one field per setting, typed with its parser's
  :attr:`~lmcache_backend.settings.parsers.Parser.annotation`, defaulting to a copy of its
  default (:func:`~lmcache_backend.settings.registry.setting_field`); the class holding the block
  is a dataclass (``BlendConfig``, ``ConnectorSettings``, ``StoreSettings``);
* ``typeddict``: one key per setting of a ``TypedDict`` (an environment-only variable by its name
  in lower case), for the typed writer of variables
  (:class:`~lmcache_backend.settings.writer.Variables`).

So an editor's "go to definition" on ``config.blend_recompute_ratios`` reaches a typed
declaration, and a type checker sees each field's type. ``lmcache-backend config --docs`` (or
``python -m lmcache_backend.settings.docs``) rewrites these blocks with the docs' tables; with
``--check`` it changes nothing and fails when a block differs (a test runs that check).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping

from lmcache_backend.settings.registry import CONNECTOR, ENGINE, ENVIRONMENT, STORE
from lmcache_backend.settings.setting import Scope, Setting

#: the files holding generated blocks, relative to the repository root
SOURCE_FILES = (
    "lmcache_backend/config.py",
    "lmcache_backend/integration/vllm/settings.py",
    "lmcache_backend/storage/settings.py",
    "lmcache_backend/settings/writer.py",
)
#: ruff's line length (pyproject.toml)
LINE_LENGTH = 100

_BLOCK = re.compile(
    r"(?P<open>(?P<indent>[ ]*)# <settings-fields: (?P<spec>[^>]*?)>\n)(?P<body>.*?)"
    r"(?P<close>[ ]*# </settings-fields>)",
    re.S,
)
_SCOPES: dict[str, Mapping[str, Setting]] = {
    "engine": ENGINE,
    "connector": CONNECTOR,
    "store": STORE,
    "environment": ENVIRONMENT,
}
#: the registry's name of each scope's table, as the generated fields refer to it
_TABLES = {"engine": "ENGINE", "connector": "CONNECTOR", "store": "STORE"}


def key_of(setting: Setting) -> str:
    """The Python name of ``setting``: an engine, connector or store key's own name, an
    environment-only variable's name in lower case (``vllm_cpu_kvcache_space``)."""
    return setting.name.lower() if setting.scope is Scope.ENVIRONMENT else setting.name


def _comment(setting: Setting, indent: str) -> list[str]:
    lead = f"{indent}#: "
    return [lead + line for line in textwrap.wrap(setting.description, LINE_LENGTH - len(lead))]


def _declaration(form: str, scope: str, setting: Setting, indent: str) -> list[str]:
    name, annotation = key_of(setting), setting.parse.annotation
    if form == "typeddict":
        return [f"{indent}{name}: {annotation}"]
    value = f'{_TABLES[scope]}["{setting.name}"]'
    line = f"{indent}{name}: {annotation} = setting_field({value})"
    if len(line) <= LINE_LENGTH:
        return [line]
    # as ruff formats a call that does not fit on one line
    return [f"{indent}{name}: {annotation} = setting_field(", f"{indent}    {value}", f"{indent})"]


def parse_spec(spec: str) -> tuple[str, list[str], set[str]]:
    """``"dataclass connector except a,b"`` -> ``("dataclass", ["connector"], {"a", "b"})``."""
    words = spec.split()
    left_out: set[str] = set()
    if "except" in words:
        at = words.index("except")
        left_out = {n for w in words[at + 1 :] for n in w.split(",") if n}
        words = words[:at]
    form, *scopes = words
    if form not in ("dataclass", "typeddict") or not scopes:
        raise ValueError(f"settings-fields {spec!r}: expected 'dataclass|typeddict SCOPE...'")
    for scope in scopes:
        if scope not in _SCOPES or (form == "dataclass" and scope not in _TABLES):
            raise ValueError(f"settings-fields {spec!r}: no {form} of scope {scope!r}")
    return form, scopes, left_out


def block(spec: str, indent: str = "    ") -> str:
    """The generated declarations of ``spec`` (see the module docstring)."""
    form, scopes, left_out = parse_spec(spec)
    lines: list[str] = []
    seen: set[str] = set()
    for scope in scopes:
        for setting in _SCOPES[scope].values():
            if setting.name in left_out:
                continue
            key = key_of(setting)
            if key in seen:
                raise ValueError(f"settings-fields {spec!r}: {key!r} is declared twice")
            seen.add(key)
            lines += _comment(setting, indent) + _declaration(form, scope, setting, indent)
    return "\n".join(lines) + "\n"


def render(text: str, source: str) -> str:
    """``text`` (the file ``source``) with every block between markers regenerated."""

    def replace(match: re.Match) -> str:
        try:
            body = block(match["spec"], match["indent"])
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        return match["open"] + body + match["close"]

    return _BLOCK.sub(replace, text)
