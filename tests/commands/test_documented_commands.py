"""Every ``lmcache-backend`` command line in the README and docs/ parses as written: its
subcommand and options exist and take the values shown (running them is what the commands'
own tests and the docs' measurements do; many take minutes to hours). ``serve`` and
``apply-patch`` hand their options to vLLM and to the patcher, which check them; a usage
synopsis (``[MODEL] [--engine hf|vllm]``) is not a command line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lmcache_backend.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)


def documented_commands() -> list[tuple[str, str]]:
    """``(file, command line)`` for each ``lmcache-backend`` line of a shell block, with its
    continuation lines joined, environment assignments and comments dropped."""
    found = []
    for path in DOCS:
        for block in BLOCK.findall(path.read_text(encoding="utf-8")):
            text = re.sub(r"\\\n\s*", " ", block)
            for line in text.splitlines():
                line = line.split(" #", 1)[0].strip()
                words = shlex.split(line, comments=True) if line else []
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words.pop(0)
                synopsis = any(w.startswith("[") or "|" in w for w in words) or "..." in words
                if words[:1] == ["lmcache-backend"] and not synopsis:
                    found.append((str(path.relative_to(ROOT)), shlex.join(words[1:])))
    return found


#: the command lines this test parses (serve's and apply-patch's options are checked by vLLM and
#: by the patcher)
COMMANDS = [
    (w, c) for w, c in documented_commands() if c.split()[0] not in ("serve", "apply-patch")
]


def test_the_docs_hold_commands() -> None:
    assert len(COMMANDS) >= 25, COMMANDS


@pytest.mark.parametrize("where, line", COMMANDS, ids=[f"{w}: {c}"[:90] for w, c in COMMANDS])
def test_a_documented_command_parses(where, line) -> None:
    argv = shlex.split(line)
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `lmcache-backend {line}` does not parse (exit {exc.code})")
