"""The vLLM step rehearsed on CPU: vLLM 0.26.0's engine from the bundle, in a venv holding only
what the GPU test machine has, with a CPU standing in for the GPU (``tools/vllm_bundle/``).

Slow (minutes: Triton's interpreter runs vLLM's attention), so it runs where the rehearsal's
environment was built: ``make vllm-rehearsal`` builds it and runs this test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from lmcache_backend.hardware import vllm_bundle

REHEARSAL = REPO_ROOT / ".cache" / "vllm-rehearsal"
BUNDLE = REPO_ROOT / ".cache" / "vllm-bundle"

pytestmark = pytest.mark.slow


@pytest.mark.skipif(
    not (REHEARSAL / "manifest.json").is_file() or not (BUNDLE / "manifest.json").is_file(),
    reason="the vLLM bundle and the rehearsal's venv are not built (make vllm-rehearsal)",
)
def test_vllm_026_serves_and_blends_through_its_gpu_model_runner_on_cpu(tmp_path: Path):
    info = json.loads((REHEARSAL / "manifest.json").read_text())
    site = vllm_bundle.unpack(BUNDLE, tmp_path, wheels=REHEARSAL / info["wheels"])
    out = tmp_path / "rehearsal.json"
    done = subprocess.run(
        [str(REHEARSAL / "venv" / "bin" / "python"), "tools/vllm_bundle/rehearse.py"]
        + ["--sizes", "300", "--chunk", "96", "--repeats", "1", "--dtype", "float32"]
        + ["--json", str(out)],
        cwd=REPO_ROOT,
        env=vllm_bundle.child_env(site, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["part"]: r for r in json.loads(out.read_text())}
    failed = {part: r.get("error") for part, r in results.items() if not r["ok"]}
    assert not failed, failed
    assert list(results) == [
        "smoke: ExampleConnector",
        "smoke: CacheBlendConnector",
        "agreement",
        "time: 300 tokens",
    ]
    # in fp32 the blend recomputing every token is vLLM's own prefill up to summation order;
    # the default ratio reuses reordered chunks: not the same numbers
    one, default = results["agreement"]["ratio 1.0"], results["agreement"]["default"]
    assert one["blended"] and one["top1_agrees"] and one["rel_err"] < 1e-4, one
    assert default["blended"] and default["rel_err"] > 1e-3, default
    assert results["time: 300 tokens"]["blended"] == "1/1"
