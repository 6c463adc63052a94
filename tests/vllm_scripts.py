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
