"""mypy over the package, held to a committed baseline of known errors that may only shrink.

    python tools/typecheck.py            # fails on an error the baseline does not hold, and on a
                                         # baseline entry that no longer occurs (shrink it)
    python tools/typecheck.py --shrink   # drop the baseline's entries that no longer occur

An error is compared without its line number (``path: message  [code]``), so that editing a file
does not move its known errors; the same error twice in a file is two entries. mypy's options are
pyproject.toml's ``[tool.mypy]``; its cache is ``.cache/mypy`` (a warm run takes seconds).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tools" / "typecheck-baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.pyi?):(?P<line>\d+)(?::\d+)?: error: (?P<message>.*)$")


def run_mypy(*args: str) -> list[str]:
    """mypy's error lines over the package (or over ``args``), from the repository root."""
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode not in (0, 1):  # 2: mypy itself failed (a bad option, a crash)
        raise RuntimeError(f"mypy failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return [line for line in done.stdout.splitlines() if _ERROR.match(line)]


def entry(line: str) -> str:
    """An error line without its line number; a line number inside the message becomes N."""
    match = _ERROR.match(line)
    if match is None:
        raise ValueError(f"not a mypy error line: {line!r}")
    message = re.sub(r"\bline \d+\b", "line N", match["message"])
    return f"{match['path']}: {message}"


def read_baseline(path: Path = BASELINE) -> Counter[str]:
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return Counter(line for line in lines if line and not line.startswith("#"))


def write_baseline(entries: Counter[str], path: Path = BASELINE) -> None:
    head = (
        "# mypy's known errors in the package (tools/typecheck.py): fix them, never add one.\n"
        "# Shrink this file with `python tools/typecheck.py --shrink` when errors go away.\n"
    )
    body = "".join(f"{e}\n" for e in sorted(entries.elements()))
    path.write_text(head + body, encoding="utf-8")


def compare(errors: list[str], baseline: Counter[str]) -> tuple[list[str], Counter[str]]:
    """``(new error lines, baseline entries that no longer occur)``."""
    current = Counter(entry(line) for line in errors)
    extra = current - baseline
    new = []
    for line in errors:  # the lines (with their numbers) of the entries beyond the baseline
        key = entry(line)
        if extra[key] > 0:
            extra[key] -= 1
            new.append(line)
    return new, baseline - current


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shrink",
        action="store_true",
        help="drop the baseline's entries that no longer occur (never adds one)",
    )
    args = parser.parse_args(argv)
    baseline = read_baseline()
    errors = run_mypy()
    new, gone = compare(errors, baseline)
    if args.shrink and gone:
        baseline -= gone
        write_baseline(baseline)
        print(f"typecheck: baseline shrunk by {sum(gone.values())} to {sum(baseline.values())}")
        gone = Counter()
    for line in new:
        print(line)
    if new:
        print(
            f"typecheck: {len(new)} new mypy error(s) above (the baseline, "
            f"{BASELINE.relative_to(ROOT)}, holds {sum(baseline.values())}): fix them",
            file=sys.stderr,
        )
    if gone:
        for key in sorted(gone.elements()):
            print(f"  fixed: {key}", file=sys.stderr)
        print(
            f"typecheck: {sum(gone.values())} known error(s) no longer occur: shrink the "
            "baseline with `python tools/typecheck.py --shrink`",
            file=sys.stderr,
        )
    if not new and not gone:
        print(f"typecheck: no new errors ({sum(baseline.values())} known, in the baseline)")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
