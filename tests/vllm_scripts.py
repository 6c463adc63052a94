"""Run a vLLM script in its own process (vLLM starts workers; a test process must not hold an
engine) and read back what it printed as ``RESULT <json>``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: the environment of the engine tests' connector: small KV cache, blending on, 15% recomputed
BLEND_ENV = {
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "LMCACHE_ENABLE_BLENDING": "true",
    "LMCACHE_BLEND_MIN_TOKENS": "32",
    "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15",
}


def run_result_script(script: Path, args: list[str], env: dict[str, str], timeout: int) -> dict:
    """Run ``python script *args``; the JSON of its last ``RESULT `` line. Fails the test with
    the end of stderr when the script fails or prints no result."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def run_blend_script(
    tmp_path: Path, source: str, args: list[str], stats: Path, timeout: int
) -> tuple[dict, list[dict]]:
    """Run the script ``source`` with the embedded model and :data:`BLEND_ENV` (over this
    process's environment without its ``LMCACHE_*`` keys): its ``RESULT`` JSON and the records
    of its ``stats`` file. Skips the test when the embedded model is not installed."""
    import pytest

    try:
        from lmcache_backend.data.embedded import embedded_model_path

        embedded_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    result = run_result_script(script, args, {**env, **BLEND_ENV}, timeout=timeout)
    lines = [json.loads(line) for line in stats.read_text().splitlines()]
    records = [r for r in lines if r.get("blended", True)]  # lines of blends only
    return result, records
