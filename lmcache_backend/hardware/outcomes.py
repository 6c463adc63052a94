"""A pytest plugin that writes every outcome, skips included, to a JSON file.

Loaded by the device-test step as ``-p lmcache_backend.hardware.outcomes --outcomes-json FILE``.
Reading pytest's own terminal output would miss the reason of a skip raised while a module is
collected (``pytest.importorskip`` at module level) and changes with pytest's formatting; the
hooks see every report, with ``--collect-only`` too, so the dry run reads the same file.

The file: ``{"collected": n, "passed": n, "failed": [...], "errors": [...], "skipped": [...]}``,
each list item ``{"nodeid": ..., "reason": ...}``. An expected failure (``xfail``) is listed
with the skips: on a device it verified nothing either.

Under pytest-xdist (``-n N``) the controller writes the file: it receives every worker's reports,
and the collected count comes from the workers' collections (each collects the whole selection),
so the workers themselves write nothing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

_STATE: dict[str, Any] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes-json", default=None, help="write every test outcome here")


def pytest_configure(config: pytest.Config) -> None:
    _STATE.clear()
    # an xdist worker has ``workerinput``; its reports reach the controller, which writes the file
    path = None if hasattr(config, "workerinput") else config.getoption("--outcomes-json")
    _STATE.update(path=path, collected=0, passed=0)
    _STATE.update(failed=[], errors=[], skipped=[])


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, message)
        return str(longrepr[2])
    text = str(getattr(report, "longreprtext", "") or longrepr or "")
    return text.strip().splitlines()[-1][:300] if text.strip() else ""


def pytest_collectreport(report: pytest.CollectReport) -> None:
    entry = {"nodeid": report.nodeid, "reason": _reason(report)}
    if report.failed:
        _STATE["errors"].append(entry)
    elif report.skipped:
        _STATE["skipped"].append(entry)


def pytest_collection_finish(session: pytest.Session) -> None:
    _STATE["collected"] = len(session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """xdist's controller collects nothing itself: count one worker's (identical) collection."""
    _STATE["collected"] = max(_STATE["collected"], len(ids))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = {"nodeid": report.nodeid, "reason": _reason(report)}
    if hasattr(report, "wasxfail"):
        entry["reason"] = f"xfail: {report.wasxfail}"
        _STATE["skipped"].append(entry)
    elif report.skipped:
        _STATE["skipped"].append(entry)
    elif report.failed:
        _STATE["errors" if report.when != "call" else "failed"].append(entry)
    elif report.passed and report.when == "call":
        _STATE["passed"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = _STATE.get("path")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({k: v for k, v in _STATE.items() if k != "path"}, fh, indent=1)
