"""``lmcache-backend hardware-check``: the dry run's table, and the rules that need no device (a
skipped device test fails the check, the table's file keeps earlier sections, the Makefile
installs the newest releases with a code path)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from lmcache_backend.hardware import device_tests, kernels, long_prompts, verify_runs
from lmcache_backend.hardware.probe import NPU_BACKEND_LABEL, offered_backends
from lmcache_backend.hardware.table import DRY, FAIL, NO_RUN_YET, PASS, SKIPPED, append_section


def _table(text: str) -> list[list[str]]:
    """The rows of the last markdown table in ``text``, as cells."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[1:]]


@pytest.mark.slow
def test_the_dry_run_prints_a_table_of_every_step(tmp_path: Path) -> None:
    out, logs = tmp_path / "hardware.md", tmp_path / "logs"
    recorded = (REPO_ROOT / "docs" / "hardware.md").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_backend", "hardware-check", "--device", "cuda"]
        + ["--dry-run", "--out", str(out), "--logs", str(logs)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (REPO_ROOT / "docs" / "hardware.md").read_text() == recorded, "a dry run never records"
    text = out.read_text()
    assert "dry run, no device" in text and "overall: passed" in text
    rows = _table(text)
    by_step: dict[str, list[list[str]]] = {}
    for row in rows:
        by_step.setdefault(row[0], []).append(row)
    assert list(by_step) == [
        "device tests",
        "kernels",
        "device blend",
        "verify",
        "8B config",
        "vLLM engine",
    ]
    for step, case, result, measurement in rows:
        # no number stands in a dry run's table: every measured cell says so
        assert result in (DRY, SKIPPED), (step, case, result)
        if result == DRY:
            assert measurement.startswith(DRY), (step, case, measurement)

    (tests,) = by_step["device tests"]
    assert "tests/backends/cuda/test_cuda_*.py" in tests[1] and "0 skipped, 0 errors" in tests[3]
    assert int(re.search(r"(\d+) collected", tests[3]).group(1)) > 100

    (bench,) = by_step["kernels"]
    assert "paged_attention" in bench[1] and "attention" in bench[1]

    # every recorded form's agreement at ~8k (ratio 1.0 and the default; naive reuse on the
    # first), then the newest form's timing, launches and syncs at both sizes
    blend = [row[1] for row in by_step["device blend"]]
    forms = {c.split(", ")[1] for c in blend[:-10]}
    assert {"0.33.0-FLASH_ATTN-LBNHC", "0.26.0-FLASH_ATTN-HND", "0.10.2-FLASH_ATTN-NHD"} <= forms
    assert len(blend) == 2 * len(forms) + 1 + 10
    assert [c.rsplit(": ", 1)[1] for c in blend[-10:]] == [
        "full prefill (SDPA)",
        "CacheBlend (blend + question), staged load",
        "CacheBlend (blend + question), direct load",
    ] * 2 + [
        "full prefill, launches and syncs per request",
        "CacheBlend, launches and syncs per request",
    ] * 2

    # every backend the probe found: four cases (two models, eager and graphs), or one row
    # saying why it is not run here
    verify = {row[1] for row in by_step["verify"]}
    for backend in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        cases = {c for c in verify if f", {backend}, " in c}
        skipped = {c for c in verify if c.startswith(f"{backend} (")}
        expected = {
            f"{m}, {backend}, {mode}" for m in ("llama31", "qwen3") for mode in ("eager", "graphs")
        }
        assert cases == expected or (not cases and len(skipped) == 1), (backend, verify)

    long = [row[1] for row in by_step["8B config"]]
    assert [c.split(": ")[1] for c in long] == ["full prefill", "CacheBlend"] * 2
    sizes = [int(c.split(" tokens")[0].replace(",", "")) for c in long[::2]]
    assert 7000 < sizes[0] < 9000 and 28000 < sizes[1] < 34000

    # vLLM from the bundle: every part, or one row saying how to build the bundle
    engine = by_step["vLLM engine"]
    if engine[0][2] == SKIPPED:
        assert len(engine) == 1 and "make vllm-bundle" in engine[0][3]
    else:
        assert [r[1] for r in engine][:3] == [
            "smoke: ExampleConnector",
            "smoke: CacheBlendConnector",
            "agreement",
        ]

    # the plumbing really ran: collected tests, the models' folders, the engine's arguments
    assert json.loads((logs / "device-tests.json").read_text())["collected"] > 100
    assert "load_format': 'dummy'" in done.stdout and "--graphs" in done.stdout


@pytest.mark.slow
def test_a_machine_without_vllm_runs_every_step_but_the_engines(tmp_path: Path) -> None:
    """vLLM made unimportable (as on a GPU machine without it): the check still runs, the two
    steps that start an engine say why they did not, and nothing fails for it."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["vllm"] = None\n')
    out = tmp_path / "hardware.md"
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_backend", "hardware-check", "--device", "cuda"]
        + ["--dry-run", "--steps", "blend,verify,8b", "--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(blocker)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _table(out.read_text())
    assert {r[0] for r in rows if r[2] == DRY} == {"device blend"}
    skipped = [r for r in rows if r[2] == SKIPPED]
    assert [r[0] for r in skipped] == ["verify", "8B config"]
    assert all("needs vLLM" in r[3] for r in skipped)


def _pytest_run(
    tmp_path: Path, body: str, dry_run: bool = False, workers: int = 0
) -> tuple[bool, str]:
    """Run ``body`` as a test file through the check's pytest command; its verdict."""
    test = tmp_path / "test_fake_device.py"
    test.write_text(textwrap.dedent(body))
    outcomes = tmp_path / "outcomes.json"
    cmd = device_tests.pytest_command([test.name], outcomes, dry_run, workers)
    cmd += ["-p", "no:cacheprovider"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return device_tests.judge(device_tests.read_outcomes(outcomes), done.returncode, dry_run)


def test_a_skipped_device_test_fails_the_check(tmp_path: Path) -> None:
    ok, summary = _pytest_run(
        tmp_path,
        """
        import pytest

        def test_runs():
            assert True

        def test_needs_a_device():
            pytest.skip("no CUDA device visible")
        """,
    )
    assert not ok
    assert "1/2 passed" in summary and "1 skipped" in summary
    assert "no CUDA device visible" in summary


def test_a_module_skipped_at_collection_fails_the_check_even_dry(tmp_path: Path) -> None:
    body = """
        import pytest

        pytest.importorskip("a_package_that_is_not_installed")

        def test_never_collected():
            pass
        """
    for dry in (False, True):
        ok, summary = _pytest_run(tmp_path, body, dry_run=dry)
        assert not ok and "a_package_that_is_not_installed" in summary, summary


def test_workers_report_every_outcome_through_the_controller(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    body = """
        import pytest

        @pytest.mark.parametrize("i", range(6))
        def test_runs(i):
            assert True

        def test_needs_a_device():
            pytest.skip("no CUDA device visible")

        def test_breaks():
            assert False
        """
    ok, summary = _pytest_run(tmp_path, body, workers=2)
    assert not ok
    assert summary.startswith("6/8 passed, 1 failed, 1 skipped, 0 errors"), summary


def test_workers_without_xdist_fail_the_row_with_the_reason(monkeypatch) -> None:
    monkeypatch.setattr(device_tests.importlib.util, "find_spec", lambda name: None)
    assert "needs pytest-xdist" in device_tests.xdist_missing(4)
    assert device_tests.xdist_missing(0) is None


def test_only_passes_pass_the_check(tmp_path: Path) -> None:
    ok, summary = _pytest_run(tmp_path, "def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    assert ok, summary
    assert summary.startswith("2/2 passed, 0 failed, 0 skipped, 0 errors")


def test_judge_fails_on_fed_skips_xfails_failures_and_missing_results() -> None:
    def fake(**changes) -> dict:
        return {"collected": 3, "passed": 3, "failed": [], "errors": [], "skipped": []} | changes

    skip = {"nodeid": "tests/backends/cuda/test_cuda_rope.py::test_x", "reason": "needs a GPU"}
    assert device_tests.judge(fake(), 0, dry_run=False)[0]
    ok, summary = device_tests.judge(fake(passed=2, skipped=[skip]), 0, dry_run=False)
    assert (
        not ok and "skipped: tests/backends/cuda/test_cuda_rope.py::test_x: needs a GPU" in summary
    )
    xfail = {"nodeid": "t::x", "reason": "xfail: known"}
    assert not device_tests.judge(fake(passed=2, skipped=[xfail]), 0, dry_run=False)[0]
    assert not device_tests.judge(fake(passed=2, failed=[skip]), 1, dry_run=False)[0]
    assert not device_tests.judge(fake(collected=0, passed=0), 5, dry_run=False)[0]
    assert not device_tests.judge(None, -11, dry_run=False)[0]
    # a dry run collects only: nothing passed, and that is fine
    assert device_tests.judge(fake(passed=0), 0, dry_run=True)[0]
    assert not device_tests.judge(fake(passed=0, skipped=[skip]), 0, dry_run=True)[0]


def test_the_selections_name_existing_files() -> None:
    cuda = device_tests.selected_files("cuda", REPO_ROOT)
    assert (
        "tests/backends/cuda/test_cuda_paged_attention.py" in cuda
        and "tests/blend/test_blend_streaming.py" in cuda
    )
    assert (
        device_tests.selected_files("npu", REPO_ROOT)[0]
        == "tests/backends/ascend/test_ascend_npu.py"
    )


def test_append_keeps_earlier_sections_and_drops_the_placeholder_on_a_real_run(tmp_path) -> None:
    doc = tmp_path / "hardware.md"
    doc.write_text(f"# Hardware\n\nIntro.\n\n{NO_RUN_YET}\n")
    append_section(doc, "## dry\n", dry_run=True)
    assert NO_RUN_YET in doc.read_text()
    append_section(doc, "## first\n", dry_run=False)
    append_section(doc, "## second\n", dry_run=False)
    text = doc.read_text()
    assert NO_RUN_YET not in text and "Intro." in text
    assert text.index("## dry") < text.index("## first") < text.index("## second")


def test_kernel_rows_fail_on_error_and_report_a_missed_target() -> None:
    def row(rel_err: float, ok: bool | None) -> dict:
        return {
            "case": "op",
            "shape": "T=1",
            "kernel_ms": 1.0,
            "baseline": "torch",
            "baseline_ms": 2.0,
            "metric": "50% of copy BW",
            "target": ">= 80%",
            "ok": ok,
            "rel_err": rel_err,
        }

    result = {"unavailable": None, "copy_gbs": 3000.0, "rows": [row(1e-3, True), row(1e-3, False)]}
    result["rows"].append(row(0.5, True))
    verdicts = [r.result for r in kernels.to_rows(result)]
    assert verdicts == ["info", PASS, kernels.BELOW_TARGET, FAIL]
    assert kernels.to_rows({"unavailable": "no GPU"})[0].result == FAIL


def test_long_prompt_rows_fail_when_cacheblend_fell_back() -> None:
    def run(ttft: float, record: dict | None) -> dict:
        return {"ttft": ttft, "peak": 20 << 30, "extra": 1 << 30, "record": record}

    good = {"fallback_reason": None, "recompute_fraction": 0.2}
    results = [
        {
            "size": 8000,
            "tokens": 8047,
            "runs": {"full prefill": [run(1.0, None)] * 3, "CacheBlend": [run(0.25, good)] * 3},
        }
    ]
    full, blend = long_prompts.to_rows(results)
    assert full.result == "info" and "TTFT 1000 ms" in full.measurement
    assert blend.result == PASS and "0.25x full prefill" in blend.measurement
    assert "+1.00 GiB over resting" in blend.measurement and "20% recomputed" in blend.measurement
    bad = {"fallback_reason": "too short", "recompute_fraction": 1.0}
    results[0]["runs"]["CacheBlend"][0] = run(0.9, bad)
    assert long_prompts.to_rows(results)[1].result == FAIL


def test_backend_selection_follows_the_release() -> None:
    kwargs, env = verify_runs.invocation("FLASHINFER", "engine_arg", graphs=True)
    assert kwargs["attention_backend"] == "FLASHINFER" and not kwargs["enforce_eager"] and not env
    kwargs, env = verify_runs.invocation("TRITON_ATTN_VLLM_V1", "env", graphs=False)
    assert env == {"vllm_attention_backend": "TRITON_ATTN_VLLM_V1"} and kwargs["enforce_eager"]
    assert "attention_backend" not in kwargs
    # older releases' V1 names are found; the plain name wins where both exist
    offered = offered_backends("cuda", ["FLASH_ATTN", "TRITON_ATTN_VLLM_V1", "FLASHINFER"])
    assert offered["FLASH_ATTN"]["name"] == "FLASH_ATTN"
    assert offered["TRITON_ATTN"]["name"] == "TRITON_ATTN_VLLM_V1"
    assert offered_backends("cuda", [])["FLASH_ATTN"]["missing"]
    assert list(offered_backends("npu", [])) == [NPU_BACKEND_LABEL]


def test_the_makefile_installs_the_newest_releases_with_a_code_path() -> None:
    from lmcache_backend.compat.ascend import supported_ascend
    from lmcache_backend.compat.vllm import NEWEST_RELEASE

    make = (REPO_ROOT / "Makefile").read_text()

    def default(name: str) -> str:
        return re.search(rf"^{name} \?= (\S+)$", make, re.M).group(1)

    newest_ascend = supported_ascend()[-1]
    assert default("VLLM_VERSION") == NEWEST_RELEASE
    assert default("VLLM_ASCEND_VERSION") == newest_ascend.version
    assert default("ASCEND_VLLM_VERSION") == newest_ascend.vllm
    assert re.search(r"^gpu-check: \$\(GPU_STAMP\)$", make, re.M)
    assert re.search(r"^npu-check: \$\(NPU_STAMP\)$", make, re.M)


def test_verify_rows_summarize_the_checks() -> None:
    checks = [
        {"name": "re-rotation error", "value": "2.58e-03", "limit": "3e-02", "passed": True},
        {
            "name": "ratio 1.0: max first-token log-probability difference (top 5)",
            "value": "0.0154",
            "limit": "1",
            "passed": True,
        },
        {
            "name": "ratio 1.0: greedy answers equal to full prefill",
            "value": "2/4",
            "limit": ">= 3/4",
            "passed": False,
        },
        {"name": "default: chunks reused", "value": "4/4 blended", "limit": "", "passed": None},
    ]
    assert verify_runs.summarize(checks) == (
        "FAILED ratio 1.0: greedy answers equal to full prefill: 2/4 (limit >= 3/4); "
        "re-rotation error 2.58e-03; ratio 1.0: max logprob diff 0.0154, 2/4 answers equal; "
        "default: 4/4 blended"
    )


def test_device_blend_rows_report_launches_syncs_busy_share_and_stages() -> None:
    """The blend step's numbers beside its times: launches (and per layer) and syncs of one
    request, how busy the GPU was under the profiler, each stage's fixed and per-token cost."""
    from lmcache_backend.hardware import device_blend

    bench = device_blend.load_benchmark()
    counts = {
        "tokens": 8000,
        "CacheBlend": {"launches": 3200, "triton": 320, "syncs": 22, "cuda_syncs": 24,
                       "sync_sites": {"aten::nonzero preview.py:64": 2}},
        "full prefill": {"launches": 1440, "triton": 0, "syncs": 1, "sync_sites": {}},
    }  # fmt: skip
    profile = {
        "tokens": 8000,
        "CacheBlend": {"wall_ms": 100.0, "kernel_ms": 85.0, "kernels": 3000, "top": []},
        "full prefill": {"wall_ms": 230.0, "kernel_ms": 225.0, "kernels": 1440, "top": []},
    }
    result = {
        "agreement": [],
        "timing": [],
        "profile": [profile],
        "counts": [counts],
        "shape_detail": {"layers": 32},
        "stage_profile": {"load": {"fixed_ms": 1.5, "per_1k_tokens_ms": 0.25}},
    }
    rows = {row.case: row.measurement for row in device_blend.to_rows(result, bench)}
    blend = rows["8,000 tokens: CacheBlend, launches and syncs per request"]
    assert "3200 launches (100 per layer; 320 Triton), 22 host-device syncs" in blend
    assert "24 seen by torch's sync debug mode" in blend and "preview.py:64 x2" in blend
    assert "GPU busy 85% of the wall time" in rows["8,000 tokens: CacheBlend, under the profiler"]
    assert rows["stage profile: load"] == "1.5 ms fixed + 0.25 ms per 1k tokens"
