"""The check's one table: its rows, how it prints, and the dated section it appends to a file."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

#: What a dry run prints in place of every measured number.
DRY = "dry run"

#: The line ``docs/hardware.md`` carries until a run on a device is recorded; the first real
#: section removes it (a dry run never does), so the file does not contradict itself.
NO_RUN_YET = "_No hardware run has been recorded yet._"

PASS, FAIL, INFO, SKIPPED = "pass", "FAIL", "info", "not run"


@dataclass
class Row:
    """One line of the table.

    Attributes:
        step: which step produced it (``device tests``, ``kernels``, ``verify``, ``8B config``).
        case: what was run (a test selection, an op, a model and attention backend, a prompt).
        result: ``pass``, ``FAIL``, ``info`` (a number, not judged), ``not run`` or ``dry run``.
        measurement: the numbers, or ``dry run``; on a failure, why and where the log is.
    """

    step: str
    case: str
    result: str
    measurement: str

    @property
    def failed(self) -> bool:
        return self.result == FAIL


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_table(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    lines = ["| step | case | result | measurement |", "|---|---|---|---|"]
    lines += [
        f"| {_cell(r.step)} | {_cell(r.case)} | {_cell(r.result)} | {_cell(r.measurement)} |"
        for r in rows
    ]
    return "\n".join(lines)


def section(
    rows: list[Row], device_name: str, versions: str, dry_run: bool, minutes: float | None
) -> str:
    """A dated markdown section: heading with the date and device, versions, verdict, table."""
    today = datetime.date.today().isoformat()
    title = f"## {today}: " + ("dry run, no device" if dry_run else device_name)
    failed = [r for r in rows if r.failed]
    verdict = f"FAILED ({len(failed)} rows)" if failed else "passed"
    took = f"; took {minutes:.0f} min" if minutes is not None else ""
    return f"{title}\n\n{versions}{took}; overall: {verdict}\n\n{format_table(rows)}\n"


def append_section(path: str | Path, text: str, dry_run: bool) -> None:
    """Append ``text`` to ``path``, keeping earlier sections; a real run drops
    :data:`NO_RUN_YET`."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if not dry_run:
        old = "\n".join(line for line in old.splitlines() if line.strip() != NO_RUN_YET)
    old = old.rstrip("\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((old + "\n\n" if old else "") + text, encoding="utf-8")
