"""Step 2: the Triton kernels timed against the device's copy bandwidth, by
``benchmarks/kernels.py`` (imported from the checkout: it is a script, not installed).

The benchmark runs in a child (``python -m lmcache_backend.hardware.kernels --json FILE``) so the
memory it leaves in torch's caching allocator is not taken from the vLLM engines started after
it. A row fails when the kernel's output is off the torch reference; a time below its target is
reported (``below target``) without failing the check: the targets are what the kernels were
designed for, not a correctness bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from lmcache_backend.hardware.children import (
    device_env,
    python_module,
    repo_root,
    run_child,
    shell_line,
    tail,
)
from lmcache_backend.hardware.table import DRY, FAIL, INFO, PASS, Row

STEP = "kernels"

#: A kernel's relative error against the fp32 torch reference above this fails (bf16 outputs
#: keep 8 mantissa bits: ~4e-3 per element; the benchmark's rows are all bf16).
MAX_REL_ERROR = 2e-2

BELOW_TARGET = "below target"

_MODULE_NAME = "lmcache_backend_benchmark_kernels"


def load_benchmark() -> ModuleType:
    """``benchmarks/kernels.py`` of the checkout, as a module."""
    path = repo_root() / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module  # its dataclass looks its module up while being built
    spec.loader.exec_module(module)
    return module


def case_names(module: ModuleType) -> list[str]:
    """The ``bench_*`` functions the benchmark runs (the dry run lists them)."""
    return sorted(name[len("bench_") :] for name in vars(module) if name.startswith("bench_"))


def to_rows(result: dict) -> list[Row]:
    """The child's JSON as table rows."""
    if result.get("unavailable"):
        return [Row(STEP, "benchmarks/kernels.py", FAIL, result["unavailable"])]
    rows = [Row(STEP, "device copy bandwidth (1 GiB bf16)", INFO, f"{result['copy_gbs']:.0f} GB/s")]
    for r in result["rows"]:
        if r["rel_err"] > MAX_REL_ERROR:
            verdict = FAIL
        else:
            verdict = INFO if r["ok"] is None else (PASS if r["ok"] else BELOW_TARGET)
        target = f" (target {r['target']})" if r["target"] != "-" else ""
        rows.append(
            Row(
                STEP,
                f"{r['case']} {r['shape']}",
                verdict,
                f"{r['kernel_ms']:.3f} ms; {r['baseline']} {r['baseline_ms']:.3f} ms: "
                f"{r['metric']}{target}; rel. error {r['rel_err']:.1e}",
            )
        )
    return rows


def run(logs: Path, dry_run: bool) -> list[Row]:
    """Time the kernels in a child; dry: load the benchmark and list what it would time."""
    out = logs / "kernels.json"
    cmd = python_module("lmcache_backend.hardware.kernels", "--json", str(out))
    if dry_run:
        module = load_benchmark()
        module.parse_args([])  # its defaults parse
        print(f"  would run: {shell_line(cmd)}")
        return [Row(STEP, "benchmarks/kernels.py: " + ", ".join(case_names(module)), DRY, DRY)]
    out.unlink(missing_ok=True)
    rc = run_child(cmd, logs / "kernels.log", env=device_env(False), timeout=1800)
    try:
        return to_rows(json.loads(out.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        why = tail(logs / "kernels.log") or str(exc)
        return [Row(STEP, "benchmarks/kernels.py", FAIL, f"exit status {rc}: {why}")]


def main(argv: list[str] | None = None) -> int:
    """Child: run the benchmark with its default sizes, write its rows as JSON."""
    parser = argparse.ArgumentParser(description="run benchmarks/kernels.py, rows as JSON")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    bench = load_benchmark()
    result: dict = {"unavailable": bench.unavailable_reason()}
    if result["unavailable"] is None:
        rows, copy_bw = bench.run(bench.parse_args([]))
        bench.print_table(rows, copy_bw, bench.torch.cuda.get_device_name())
        result["copy_gbs"] = copy_bw / 1e9
        result["rows"] = [dataclasses.asdict(r) for r in rows]
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
