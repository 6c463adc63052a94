"""The key tables of the README and the docs, and the settings objects' typed fields, generated
from the settings registry.

A table lives between two markers in a Markdown file::

    <!-- settings-table: engine blend,ops -->
    | key | ... |
    <!-- /settings-table -->

naming a scope (``engine``, ``connector``, ``store``, ``request``, ``environment``) and,
optionally, the groups of its settings to show. ``lmcache-backend config --docs`` (or ``python -m
lmcache_backend.settings.docs``) rewrites every such table from the registry, and every block of
typed fields in the code (:mod:`lmcache_backend.settings.codegen`); with ``--check`` it changes
nothing and fails when a table or a block differs (a test runs that check).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmcache_backend.settings import codegen
from lmcache_backend.settings.registry import CONNECTOR, ENGINE, ENVIRONMENT, REQUEST, STORE
from lmcache_backend.settings.setting import Setting

#: the files holding tables, relative to the repository root
DOC_FILES = ("README.md", "docs/vllm.md", "docs/storage.md", "docs/security.md")

_BLOCK = re.compile(
    r"(?P<open><!-- settings-table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)"
    r"(?P<close><!-- /settings-table -->)",
    re.S,
)
_SCOPES = {
    "engine": ENGINE,
    "connector": CONNECTOR,
    "store": STORE,
    "request": REQUEST,
    "environment": ENVIRONMENT,
}


def shown_default(setting: Setting) -> str:
    """The default as a table shows it."""
    if setting.default_doc:
        return setting.default_doc
    value = setting.default
    if value is None:
        return "unset" if setting.env == setting.name else "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and (value != value.strip() or not value):
        return f'`"{value}"`'
    return f"`{value}`"


def _request_default(setting: Setting) -> str:
    """A request's default: the engine's setting, for an engine key a request may set."""
    return "the engine's" if setting.per_request else shown_default(setting)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _meaning(setting: Setting) -> str:
    text = setting.description
    if setting.details:
        text += ("; " if text[-1:] != "." else " ") + setting.details
    if setting.aliases:
        text += f" (formerly {', '.join(f'`{a}`' for a in setting.aliases)})"
    return text


def table(scope: str, groups: Iterable[str] = ()) -> str:
    """The Markdown table of ``scope``'s settings (of ``groups`` only, if any)."""
    wanted = set(groups)
    settings = [s for s in _SCOPES[scope].values() if not wanted or s.group in wanted]
    if scope == "environment":
        head = "| variable | default | values | defined by | meaning |\n|---|---|---|---|---|\n"
        rows = [
            f"| `{s.name}` | {shown_default(s)} | {_cell(s.parse.accepts)} | "
            f"{'this package' if s.owner == 'lmcache_backend' else s.owner} | "
            f"{_cell(_meaning(s))} |"
            for s in settings
        ]
    else:
        key = "key (`LMCACHE_<KEY>`)" if scope == "engine" else "key"
        head = f"| {key} | default | values | meaning |\n|---|---|---|---|\n"
        rows = [
            f"| `{s.name}` | {_request_default(s) if scope == 'request' else shown_default(s)} | "
            f"{_cell(s.parse.accepts)} | {_cell(_meaning(s))} |"
            for s in settings
        ]
    return head + "\n".join(rows) + "\n"


def _relative_links(text: str, doc: str) -> str:
    """Links written from the repository root (``docs/x.md``), made relative to ``doc``."""
    if doc.startswith("docs/"):
        return text.replace("](docs/", "](")
    return text


def render(text: str, doc: str) -> str:
    """``text`` (the file ``doc``) with every table between markers regenerated."""

    def replace(match: re.Match) -> str:
        scope, *rest = match["spec"].split()
        groups = rest[0].split(",") if rest else ()
        if scope not in _SCOPES:
            raise ValueError(f"{doc}: unknown settings table {match['spec']!r}")
        body = _relative_links(table(scope, groups), doc)
        return match["open"] + body + match["close"]

    return _BLOCK.sub(replace, text)


def stale(root: Path) -> dict[str, tuple[str, str]]:
    """``{file: (current text, generated text)}`` of the files whose tables (docs) or typed
    fields (code, :data:`~lmcache_backend.settings.codegen.SOURCE_FILES`) differ."""
    out: dict[str, tuple[str, str]] = {}
    renderers: list[tuple[str, Callable[[str, str], str]]] = [(doc, render) for doc in DOC_FILES]
    renderers += [(source, codegen.render) for source in codegen.SOURCE_FILES]
    for name, renderer in renderers:
        text = (root / name).read_text(encoding="utf-8")
        new = renderer(text, name)
        if new != text:
            out[name] = (text, new)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lmcache-backend config --docs", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root", default=".", help="the repository root (default: the current folder)"
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 when a table is stale"
    )


def run(args: Any) -> int:
    root = Path(args.root)
    missing = [f for f in (*DOC_FILES, *codegen.SOURCE_FILES) if not (root / f).is_file()]
    if missing:
        print(
            f"lmcache-backend config --docs: {root} is not the repository root "
            f"(missing {', '.join(missing)})",
            file=sys.stderr,
        )
        return 2
    changed = stale(root)
    if args.check:
        for doc in changed:
            what = "typed fields" if doc.endswith(".py") else "tables"
            print(f"{doc}: settings {what} differ from the registry", file=sys.stderr)
        if changed:
            print("run `lmcache-backend config --docs` to regenerate them", file=sys.stderr)
        return 1 if changed else 0
    for doc, (_, new) in changed.items():
        (root / doc).write_text(new, encoding="utf-8")
        print(f"rewrote the settings {'fields' if doc.endswith('.py') else 'tables'} of {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
