"""``lmcache-backend hardware-check --device cuda|npu [--dry-run]``: the steps in order, one
table, a dated section appended to ``docs/hardware.md``.

Exit status: 0 when no row failed, 1 when one did, 2 when the device is not usable (nothing is
written then). A failing step becomes a failed row and the next step still runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lmcache_backend.hardware import (
    device_blend,
    device_tests,
    kernels,
    long_prompts,
    verify_runs,
    vllm_step,
)
from lmcache_backend.hardware.children import python_module, repo_root, run_child, tail
from lmcache_backend.hardware.table import FAIL, SKIPPED, Row, append_section, section
from lmcache_backend.settings.writer import export

STEPS = ("tests", "kernels", "blend", "verify", "8b", "vllm")
#: the steps that start a vLLM engine; where vLLM does not import they are not run (their rows
#: say so) and the rest of the check still runs: it needs only torch, triton and transformers
NEEDS_VLLM = {"verify": verify_runs.STEP, "8b": long_prompts.STEP}
DEVICE_NAMES = {"cuda": "CUDA GPU", "npu": "Ascend NPU"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=("cuda", "npu"), required=True, help="the device to check"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="no device: print the commands, collect the device tests, build the models' "
        "folders and arguments, print the table with 'dry run' for numbers",
    )
    parser.add_argument(
        "--out",
        help="markdown file the dated section is appended to (default: docs/hardware.md; "
        "with --dry-run a new temporary file)",
    )
    parser.add_argument("--logs", help="folder for the steps' logs (default: out/hardware/DATE)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"subset of {','.join(STEPS)}")
    parser.add_argument(
        "--models",
        default=",".join(verify_runs.DEFAULT_MODELS),
        help="comma list of models verify runs per attention backend "
        f"(default: {','.join(verify_runs.DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--sizes", default="8000,32000", help="prompt sizes of the 8B-shaped steps, tokens"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed rounds per prompt size (8B-shaped steps)"
    )
    parser.add_argument(
        "--vllm-bundle",
        help="the vllm step's bundle folder (default: .cache/vllm-bundle of the checkout; "
        "`make vllm-bundle` builds it)",
    )
    parser.add_argument(
        "--vllm-sizes",
        default=",".join(map(str, vllm_step.DEFAULT_SIZES)),
        help="prompt sizes of the vllm step, tokens",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="run the device tests in this many processes (needs pytest-xdist; default: one)",
    )


def probe(device: str, logs: Path) -> dict:
    """The probe child's answer; a failure to run it becomes an unusable device."""
    out = logs / "probe.json"
    cmd = python_module("lmcache_backend.hardware.probe", "--device", device, "--json", str(out))
    rc = run_child(cmd, logs / "probe.log", timeout=600)
    try:
        return json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        why = f"the probe failed (exit status {rc}): {tail(logs / 'probe.log')}"
        return {"device": {"unavailable": why, "name": None}, "versions": {}, "backends": {}}


def versions_line(info: dict) -> str:
    """Versions of what ran, and the checkout's commit."""
    v = info.get("versions", {})
    parts = [f"torch {v.get('torch')}" + (f" (CUDA {v['cuda']})" if v.get("cuda") else "")]
    for key, name in (
        ("vllm", "vLLM"),
        ("vllm_ascend", "vllm-ascend"),
        ("torch_npu", "torch-npu"),
        ("triton", "triton"),
        ("lmcache_backend", "lmcache-backend"),
    ):
        if v.get(key):
            parts.append(f"{name} {v[key]}")
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo_root(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        parts[-1] += f" (git {commit})"
    except (OSError, subprocess.CalledProcessError):
        pass  # not a git checkout: the versions alone
    return ", ".join(parts)


def _kernels(args: argparse.Namespace, info: dict, logs: Path, cache: Path) -> list[Row]:
    if args.device == "npu":
        why = "benchmarks/kernels.py times the CUDA (Triton) kernels; none for torch-npu yet"
        return [Row(kernels.STEP, "benchmarks/kernels.py", SKIPPED, why)]
    return kernels.run(logs, args.dry_run)


def _verify(args: argparse.Namespace, info: dict, logs: Path, cache: Path) -> list[Row]:
    models = [m for m in args.models.split(",") if m]
    return verify_runs.run(info, models, cache, logs, args.dry_run)


def _long(args: argparse.Namespace, info: dict, logs: Path, cache: Path) -> list[Row]:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    return long_prompts.run(cache, logs, sizes, args.repeats, args.dry_run)


def _blend(args: argparse.Namespace, info: dict, logs: Path, cache: Path) -> list[Row]:
    if args.device == "npu":
        why = "benchmarks/device_blend.py runs the CUDA cache forms and kernels; none for NPUs yet"
        return [Row(device_blend.STEP, "benchmarks/device_blend.py", SKIPPED, why)]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    return device_blend.run(logs, sizes, args.repeats, args.dry_run)


def _vllm(args: argparse.Namespace, info: dict, logs: Path, cache: Path) -> list[Row]:
    if args.device == "npu":
        return [Row(vllm_step.STEP, "every part", SKIPPED, "the bundle holds vLLM's CUDA build")]
    sizes = [int(s) for s in args.vllm_sizes.split(",") if s]
    return vllm_step.run(logs, args.vllm_bundle, sizes, args.repeats, args.dry_run)


def _tests(args: argparse.Namespace, info: dict, logs: Path, cache: Path) -> list[Row]:
    return device_tests.run(args.device, logs, args.dry_run, args.workers)


_STEP_FUNCS: dict[str, Callable[[argparse.Namespace, dict, Path, Path], list[Row]]] = {
    "tests": _tests,
    "kernels": _kernels,
    "blend": _blend,
    "verify": _verify,
    "8b": _long,
    "vllm": _vllm,
}


def main(args: argparse.Namespace) -> int:
    start = time.monotonic()
    steps = [s for s in args.steps.split(",") if s]
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {','.join(STEPS)}")
    if not args.dry_run:
        # Triton reads it once, at import: every kernel must be compiled for the device
        export(triton_interpret=None)
    root = repo_root()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.logs:
        logs = Path(args.logs)
    elif args.dry_run:
        logs = Path(tempfile.mkdtemp(prefix="hardware-check-"))
    else:
        logs = root / "out" / "hardware" / stamp
    logs.mkdir(parents=True, exist_ok=True)
    from lmcache_backend.data.embedded import cache_root

    cache = cache_root() / "hardware-check"
    mode = "dry run" if args.dry_run else "on the device"
    print(f"hardware check, {DEVICE_NAMES[args.device]}, {mode}; logs in {logs}", flush=True)

    print("[probe] device, versions, attention backends", flush=True)
    info = probe(args.device, logs)
    unavailable = info["device"]["unavailable"]
    if unavailable and not args.dry_run:
        print(f"no usable {DEVICE_NAMES[args.device]}: {unavailable}; nothing written")
        return 2
    rows: list[Row] = []
    no_vllm = info.get("vllm_error")
    for step in steps:
        print(f"[{step}]", flush=True)
        if step in NEEDS_VLLM and no_vllm:
            why = f"needs vLLM: {no_vllm}; runs where vLLM is installed"
            rows.append(Row(NEEDS_VLLM[step], "every case", SKIPPED, why))
            print(f"  {why}", flush=True)
            continue
        try:
            rows += _STEP_FUNCS[step](args, info, logs, cache)
        except Exception as exc:  # noqa: BLE001 - one broken step must not lose the others' rows
            rows.append(Row(step, "-", FAIL, f"{type(exc).__name__}: {exc}"))

    device_name = info["device"]["name"] or f"no {DEVICE_NAMES[args.device]}"
    minutes = None if args.dry_run else (time.monotonic() - start) / 60
    text = section(rows, device_name, versions_line(info), args.dry_run, minutes)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
    elif args.dry_run:
        out = Path(tempfile.mkstemp(prefix="hardware-check-", suffix=".md")[1])
    else:
        out = root / "docs" / "hardware.md"
    append_section(out, text, args.dry_run)
    print(f"appended to {out} ({time.monotonic() - start:.0f} s)")
    return 1 if any(r.failed for r in rows) else 0
