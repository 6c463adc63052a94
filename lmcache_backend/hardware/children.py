"""Child processes of the check: where the checkout is, the environment they get, and running one
with its output in a log file.

Every engine and the test session run in a child of their own: vLLM does not give back all of a
device's memory when an engine shuts down, a crash of one case must not end the others, and each
child's output stays in one file to read afterwards.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import lmcache_backend
from lmcache_backend.settings.writer import child_env


def repo_root() -> Path:
    """The checkout the check runs from: the tests and ``benchmarks/`` are not installed, so the
    current directory when it holds them, else the folder above an editable install."""
    for candidate in (Path.cwd(), Path(lmcache_backend.__file__).resolve().parents[1]):
        if (candidate / "tests" / "conftest.py").is_file() and (candidate / "benchmarks").is_dir():
            return candidate
    raise FileNotFoundError(
        "run the hardware check from a checkout of lmcache-backend (it needs tests/ and "
        "benchmarks/), e.g. `make gpu-check` at the repository's root"
    )


def device_env(dry_run: bool) -> dict[str, str]:
    """This process's environment for a child. On a device ``TRITON_INTERPRET`` is dropped: the
    kernels must be compiled, never interpreted (the dry run keeps it: there is no GPU)."""
    return child_env() if dry_run else child_env(triton_interpret=None)


def python_module(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter (the check's own environment)."""
    return [sys.executable, "-m", module, *args]


def shell_line(cmd: list[str], env_changes: dict[str, str] | None = None) -> str:
    """``cmd`` as a user would type it, with the variables it sets in front."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env_changes or {}).items())
    line = shlex.join(cmd).replace(shlex.quote(sys.executable), "python")
    return f"{prefix} {line}" if prefix else line


def run_child(
    cmd: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> int:
    """Run ``cmd`` from the checkout with stdout and stderr in ``log``; its exit status (124 when
    it ran past ``timeout`` seconds and was killed)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  $ {shell_line(cmd)}\n    (log: {log})", flush=True)
    with open(log, "w", encoding="utf-8") as fh:
        try:
            done = subprocess.run(
                cmd,
                cwd=repo_root(),
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            fh.write(f"\n[hardware-check] killed after {timeout:.0f} s\n")
            return 124
    return done.returncode


def tail(log: Path, lines: int = 2) -> str:
    """The last non-empty lines of a log, joined, for a table cell."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " / ".join(kept)[:300]
