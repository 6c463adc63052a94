"""Step 1: the device tests, compiled on the device, with no skip allowed.

The selection is by path. pytest runs in a child with ``TRITON_INTERPRET`` removed from its
environment and :mod:`lmcache_backend.hardware.outcomes` loaded, which writes every outcome to a
JSON file; :func:`judge` reads it. A skipped test fails the check like a failed one: on the
machine the check exists for, a skip means something it was meant to verify was not verified
(a missing package, a device the test did not see). The dry run collects the same selection
(``--collect-only``), which runs every module's imports and collection-time skips in seconds,
where running ~1,000 kernel tests in Triton's interpreter would take many minutes on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from lmcache_backend.hardware.children import device_env, python_module, repo_root, run_child
from lmcache_backend.hardware.table import DRY, FAIL, PASS, Row

STEP = "device tests"

#: The connector and layout tests, which run on either device.
_CONNECTOR = (
    "tests/integration/vllm/test_connector_device_path.py",
    "tests/integration/vllm/test_vllm_layouts_contract.py",
)

#: Paths (globs relative to the checkout) per device.
SELECTIONS: dict[str, tuple[str, ...]] = {
    "cuda": (
        "tests/backends/cuda/test_cuda_*.py",
        "tests/backends/test_blender_backends.py",
        *_CONNECTOR,
        "tests/blend/test_blend_streaming.py",
    ),
    "npu": ("tests/backends/ascend/test_ascend_npu.py", *_CONNECTOR),
}


def selected_files(device: str, root: Path | None = None) -> list[str]:
    """The selection's files, sorted within each glob; a glob matching nothing is an error."""
    root = root or repo_root()
    files: list[str] = []
    for pattern in SELECTIONS[device]:
        matches = sorted(str(p.relative_to(root)) for p in root.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"{pattern} matches no file under {root}")
        files += matches
    return files


def pytest_command(files: list[str], outcomes: Path, dry_run: bool, workers: int = 0) -> list[str]:
    """The pytest command line; ``-rs`` lists the skips in the log as well. ``workers`` > 0
    spreads the tests over that many processes with pytest-xdist (the kernels' first compiles
    dominate the step, and they run on the CPU cores)."""
    cmd = python_module("pytest", "-q", "-rs", "-p", "lmcache_backend.hardware.outcomes")
    cmd += ["--outcomes-json", str(outcomes)]
    if dry_run:
        cmd.append("--collect-only")
    elif workers > 0:
        cmd += ["-n", str(workers)]
    return cmd + files


def xdist_missing(workers: int) -> str | None:
    """Why ``workers`` cannot be honoured (pytest-xdist not installed), else None."""
    if workers > 0 and importlib.util.find_spec("xdist") is None:
        return f"--workers {workers} needs pytest-xdist (pip install pytest-xdist)"
    return None


def judge(outcomes: dict | None, returncode: int, dry_run: bool) -> tuple[bool, str]:
    """Whether the session passed the check, and a one-line summary.

    It fails on: no outcome file (pytest crashed), nothing collected, a collection error, a
    failed or erroring test, **any skipped or xfailed test**, and, on a device, a non-zero exit
    status or fewer passes than collected tests.
    """
    if outcomes is None:
        return False, f"pytest wrote no outcomes (exit status {returncode})"
    collected, passed = outcomes.get("collected", 0), outcomes.get("passed", 0)
    failed, errors = outcomes.get("failed", []), outcomes.get("errors", [])
    skipped = outcomes.get("skipped", [])
    counts = (
        f"{collected} collected"
        if dry_run
        else f"{passed}/{collected} passed, {len(failed)} failed"
    )
    counts += f", {len(skipped)} skipped, {len(errors)} errors"
    problems = []
    if collected == 0:
        problems.append("no test collected")
    for label, entries in (("skipped", skipped), ("failed", failed), ("error", errors)):
        if entries:
            first = entries[0]
            problems.append(f"{label}: {first['nodeid']}: {first['reason']}")
    if not dry_run and returncode != 0 and not problems:
        problems.append(f"pytest exited with status {returncode}")
    if not dry_run and passed != collected and not problems:
        problems.append(f"only {passed} of {collected} tests passed")
    return not problems, "; ".join([counts, *problems])


def read_outcomes(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def run(device: str, logs: Path, dry_run: bool, workers: int = 0) -> list[Row]:
    """Run (or, dry, collect) the selection for ``device``; one table row."""
    files = selected_files(device)
    case = ", ".join(SELECTIONS[device])
    missing = xdist_missing(workers)
    if missing:
        return [Row(STEP, case, FAIL, missing)]
    outcomes_path = logs / "device-tests.json"
    outcomes_path.unlink(missing_ok=True)
    cmd = pytest_command(files, outcomes_path, dry_run, workers)
    start = time.monotonic()
    rc = run_child(cmd, logs / "device-tests.log", env=device_env(dry_run), timeout=3600)
    ok, summary = judge(read_outcomes(outcomes_path), rc, dry_run)
    seconds = time.monotonic() - start
    if dry_run:
        return [Row(STEP, case, DRY if ok else FAIL, f"{DRY} ({summary})")]
    return [Row(STEP, case, PASS if ok else FAIL, f"{summary}; {seconds:.0f} s")]
