"""The vLLM runtime bundle's pieces that need no download: the stand-ins for vLLM's compiled
extensions, the bundle's zip of vLLM's Python, the pins, the step's model folder and rows."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from repo_paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

from vllm_bundle import build, spec  # noqa: E402

from lmcache_backend.hardware import vllm_bundle, vllm_model, vllm_step  # noqa: E402
from lmcache_backend.hardware.table import FAIL, PASS, SKIPPED  # noqa: E402

STANDIN = REPO_ROOT / "tools" / "vllm_bundle" / "standin" / "_C_stable_libtorch.py"


#: run in a fresh interpreter: the stand-in registers ops in torch's ``_C`` namespace, where
#: vLLM's CPU build (imported by other tests in this process) defines some of the same names
STANDIN_CHECK = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("standin", sys.argv[1])
standin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(standin)
for name in standin.PROBES:
    assert getattr(torch.ops._C, name)(90) is False, name
try:
    torch.ops._C.silu_and_mul(torch.empty(4, 4), torch.randn(4, 8))
except standin.StandInOpCalled as exc:
    assert "torch.ops._C.silu_and_mul" in str(exc), exc
else:
    raise AssertionError("silu_and_mul computed")
for name in standin.NAMED_ONLY:  # vLLM's modules read .default of the ops they name at import
    assert getattr(torch.ops._C, name).default is not None, name
print("ok", len(standin.PROBES), len(standin.NAMED_ONLY))
"""


def test_the_stand_in_answers_unsupported_and_refuses_to_compute_what_it_only_names():
    done = subprocess.run(
        [sys.executable, "-c", STANDIN_CHECK, str(STANDIN)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    word, probes, named = done.stdout.split()
    assert word == "ok" and int(probes) > 0 and int(named) > 0, done.stdout


def test_the_stand_in_keeps_the_extension_schemas():
    """Each op's schema is the one vLLM 0.26.0's extension registers (read from the wheel's
    shared library): vLLM's fusion passes match on them."""
    text = STANDIN.read_text()
    assert "silu_and_mul" in text and "(Tensor! result, Tensor input) -> ()" in text
    assert '"rotary_embedding"' in text and "bool is_neox, int rope_dim_offset=0" in text


def _fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm/_C_stable_libtorch.abi3.so", b"\x7fELF")
        zf.writestr("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", b"\x7fELF")
        zf.writestr("vllm/vllm_flash_attn/__init__.py", "")
        zf.writestr("vllm/csrc/kernel.cu", "")
        zf.writestr("vllm/vllm-rs", b"\x7fELF")
        zf.writestr("vllm/config.json", "{}")
        zf.writestr("vllm-0.26.0.dist-info/METADATA", "Name: vllm\nVersion: 0.26.0\n")
    return path


def test_the_python_zip_drops_compiled_code_adds_the_stand_ins_and_is_reproducible(tmp_path):
    wheel = _fake_wheel(tmp_path / "vllm.whl")
    first, second = tmp_path / "a.zip", tmp_path / "b.zip"
    contents = build.python_zip(wheel, first)
    build.python_zip(wheel, second)
    assert first.read_bytes() == second.read_bytes()
    names = set(zipfile.ZipFile(first).namelist())
    assert names == {
        "vllm/__init__.py",
        "vllm/vllm_flash_attn/__init__.py",
        "vllm/config.json",
        "vllm-0.26.0.dist-info/METADATA",
        *spec.STAND_INS.values(),
    }
    assert contents["left_out"] == 4
    # what it unpacks to: vLLM's package with its dist-info (CUDA detection reads the version)
    bundle = tmp_path / "bundle"
    (bundle / "wheels-cp312").mkdir(parents=True)
    first.rename(bundle / "vllm.zip")
    manifest = {"python": "3.12", "python_zip": "vllm.zip", "wheels": "wheels-cp312"}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    site = vllm_bundle.unpack(bundle, tmp_path / "out")
    assert (site / "vllm" / "_C_stable_libtorch.py").read_text().count("STAND-IN") == 1
    assert (site / "vllm-0.26.0.dist-info" / "METADATA").is_file()
    env = vllm_bundle.child_env(site, {"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(":") == [str(site), "/elsewhere"]


def test_the_bundle_brings_nothing_the_gpu_machine_has():
    bundled = {spec.name_of(p).lower() for p in spec.DEPENDENCIES}
    there = {spec.name_of(p).lower() for p in spec.GPU_MACHINE}
    assert not bundled & there
    assert all("==" in p for p in spec.DEPENDENCIES + spec.GPU_MACHINE)


def test_the_step_model_tokenizer_gives_the_connector_its_separator(tmp_path):
    """The connector derives the separator's ids from the model's tokenizer at start-up: with
    the step's character tokenizer they are the ids the step's prompts use."""
    from transformers import AutoTokenizer

    from lmcache_backend.blend.segmenting import separator_pattern
    from lmcache_backend.config import load_config

    folder = vllm_model.write_folder(tmp_path / "tiny", "tiny", 1024)
    tok = AutoTokenizer.from_pretrained(str(folder))
    pattern = separator_pattern(tok, load_config().blend_special_str)
    assert list(pattern.ids) == vllm_model.SEPARATOR_IDS
    assert len(tok) == vllm_model.TINY["vocab_size"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_the_step_without_a_bundle_says_how_to_build_it(tmp_path):
    rows = vllm_step.run(tmp_path, str(tmp_path / "none"), [2000], 3, dry_run=True)
    assert [r.result for r in rows] == [SKIPPED]
    assert "make vllm-bundle" in rows[0].measurement


def test_a_failed_part_names_the_missing_piece_and_numbers_read_as_rows():
    failed = vllm_step.row(
        {"part": "agreement", "ok": False, "error": "AttributeError: no op rotary at x.py:3"}, "m"
    )
    assert failed.result == FAIL and "rotary" in failed.measurement
    timed = {
        "part": "time: 8,000 tokens",
        "ok": True,
        "tokens": 7808,
        "full prefill": {
            "ttft_ms": 300.0,
            "spread_ms": [290.0, 310.0],
            "ttft_from": "vllm",
            "peak_gib": 20.0,
            "extra_gib": 1.0,
        },
        "CacheBlend": {
            "ttft_ms": 150.0,
            "spread_ms": [140.0, 160.0],
            "ttft_from": "vllm",
            "peak_gib": 19.0,
            "extra_gib": 0.5,
        },
        "blended": "3/3",
        "why_not": [],
    }
    row = vllm_step.row(timed, "m")
    assert row.result == PASS and "0.50x" in row.measurement and "3/3 blended" in row.measurement


def test_a_failure_is_placed_at_vllms_line_that_called_the_stand_in():
    from lmcache_backend.hardware.vllm_engine import failure

    ns: dict = {}
    exec(
        compile(
            "def op():\n    raise RuntimeError('no kernel')\n",
            "/s/vllm/_C_stable_libtorch.py",
            "exec",
        ),
        ns,
    )  # noqa: E501
    exec(
        compile("def forward(op):\n    return op()\n", "/s/vllm/model_executor/norm.py", "exec"), ns
    )  # noqa: E501
    try:
        ns["forward"](ns["op"])
    except RuntimeError as exc:
        got = failure("smoke", exc)
    assert got == {"part": "smoke", "ok": False, "error": "RuntimeError: no kernel at norm.py:2"}
