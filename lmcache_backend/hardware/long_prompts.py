"""Step 4: the Llama-3.1-8B-shaped model (dummy weights) with the connector at ~8k and ~32k
tokens: time to first token and peak device memory, CacheBlend against full prefill.

One engine (a child process) serves every size. Per size it stores the chunks of a RAG prompt
(one full prefill), runs one untimed round of each mode, then ``--repeats`` timed rounds of

* **full prefill**: the reordered prompt with the request opted out (``{"blend": false}``);
* **CacheBlend**: the same prompt blended with the engine's settings,

each with a new question, interleaved, on the same engine. TTFT is a one-token request's wall
time as a client sees it (median). Memory is ``torch.cuda.max_memory_allocated`` (``torch.npu``
on an NPU) read in the worker through ``collective_rpc``, its peak reset before each request:
the peak during the request, and how far it rose above the allocation before it (weights and
vLLM's preallocated KV-cache pool), which is the request's own working memory. It does not count
memory outside torch's allocator (CUDA graphs' pools, NCCL, the driver's context).

Child: ``python -m lmcache_backend.hardware.long_prompts --model-dir DIR --sizes 8000,32000
--repeats 3 --json FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lmcache_backend.hardware import llama8b
from lmcache_backend.hardware.children import (
    device_env,
    python_module,
    run_child,
    shell_line,
    tail,
)
from lmcache_backend.hardware.table import DRY, FAIL, INFO, PASS, Row

STEP = "8B config"
CHILD = "lmcache_backend.hardware.long_prompts"
MODES = (("full prefill", {"blend": False}), ("CacheBlend", {}))
GIB = 1 << 30


def _accelerator():
    """``torch.cuda``, or ``torch.npu`` where torch_npu made it usable."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return npu
    raise RuntimeError("no CUDA or NPU device in this worker")


def worker_reset_peak(worker: object = None) -> int:
    """In the worker: reset the peak statistic; the bytes allocated now."""
    device = _accelerator()
    device.synchronize()
    device.reset_peak_memory_stats()
    return int(device.memory_allocated())


def worker_peak(worker: object = None) -> int:
    """In the worker: the peak bytes allocated since the last reset."""
    device = _accelerator()
    device.synchronize()
    return int(device.max_memory_allocated())


def measure(model_dir: str, sizes: list[int], repeats: int) -> list[dict]:
    """The child's work: one engine, every size, both modes."""
    from lmcache_backend.integration.vllm.offline import generate_one, offline_engine, read_records
    from lmcache_backend.settings.writer import export

    prompts = llama8b.build_prompts(Path(model_dir), sizes, repeats + 1)
    longest = max(len(p) for warm, asked in prompts.values() for p in [warm, *asked])
    # collective_rpc sends these functions pickled only when allowed; this is the check's engine
    export(defaults={"vllm_allow_insecure_serialization": True})
    stats = os.path.join(tempfile.mkdtemp(prefix="hardware-check-"), "stats.jsonl")
    kwargs = llama8b.engine_kwargs(longest)
    llm = offline_engine(model_dir, stats_file=stats, extra_config=llama8b.EXTRA_CONFIG, **kwargs)

    def ask(ids: list[int], params: dict) -> dict:
        before = len(read_records(stats))
        resting = max(llm.collective_rpc(worker_reset_peak))
        start = time.perf_counter()
        generate_one(llm, ids, 1, params)
        ttft = time.perf_counter() - start
        peak = max(llm.collective_rpc(worker_peak))
        new = read_records(stats)[before:]
        return {
            "ttft": ttft,
            "peak": peak,
            "extra": peak - resting,
            "record": new[-1] if new else None,
        }

    results = []
    try:
        for size in sizes:
            warm, asked = prompts[size]
            ask(warm, {"blend": False})  # prefills and stores the chunks
            runs: dict[str, list[dict]] = {name: [] for name, _ in MODES}
            for i, ids in enumerate(asked):
                for name, params in MODES:
                    got = ask(ids, params)
                    if i > 0:  # round 0 warms this prompt length up
                        runs[name].append(got)
            results.append({"size": size, "tokens": len(asked[0]), "runs": runs})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results


def _memory(runs: list[dict]) -> str:
    peak = max(r["peak"] for r in runs) / GIB
    extra = statistics.median(r["extra"] for r in runs) / GIB
    return f"peak {peak:.1f} GiB, +{extra:.2f} GiB over resting"


def to_rows(results: list[dict]) -> list[Row]:
    """Two rows per size: full prefill (reported), CacheBlend (fails when it did not blend)."""
    rows = []
    for item in results:
        full, blend = item["runs"]["full prefill"], item["runs"]["CacheBlend"]
        full_ms = 1000 * statistics.median(r["ttft"] for r in full)
        blend_ms = 1000 * statistics.median(r["ttft"] for r in blend)
        case = f"{item['tokens']:,} tokens"
        n = len(full)
        rows.append(
            Row(STEP, f"{case}: full prefill", INFO, f"TTFT {full_ms:.0f} ms; {_memory(full)}")
        )
        records = [r["record"] for r in blend]
        blended = [r for r in records if r and not r.get("fallback_reason")]
        fallbacks = {r["fallback_reason"] for r in records if r and r.get("fallback_reason")}
        recomputed = statistics.mean(r.get("recompute_fraction", 0.0) for r in blended or [{}])
        verdict = PASS if len(blended) == len(records) else FAIL
        why = f"; fell back: {', '.join(sorted(fallbacks))}" if fallbacks else ""
        rows.append(
            Row(
                STEP,
                f"{case}: CacheBlend",
                verdict,
                f"TTFT {blend_ms:.0f} ms = {blend_ms / full_ms:.2f}x full prefill (medians of "
                f"{n}); {_memory(blend)}; {len(blended)}/{len(records)} blended, "
                f"{recomputed:.0%} recomputed{why}",
            )
        )
    return rows


def run(cache: Path, logs: Path, sizes: list[int], repeats: int, dry_run: bool) -> list[Row]:
    """Write the folder; on the device run the child, dry: build prompts and arguments only."""
    folder = llama8b.write_folder(cache)
    out = logs / "long-prompts.json"
    args = ["--model-dir", str(folder), "--sizes", ",".join(map(str, sizes))]
    cmd = python_module(CHILD, *args, "--repeats", str(repeats), "--json", str(out))
    if dry_run:
        prompts = llama8b.build_prompts(folder, sizes, repeats + 1)
        longest = max(len(p) for warm, asked in prompts.values() for p in [warm, *asked])
        kwargs = llama8b.engine_kwargs(longest)
        print(f"  would run: {shell_line(cmd)}\n    offline_engine({str(folder)!r}, {kwargs})")
        return [
            Row(STEP, f"{len(prompts[s][1][0]):,} tokens: {mode}", DRY, DRY)
            for s in sizes
            for mode, _ in MODES
        ]
    out.unlink(missing_ok=True)
    rc = run_child(cmd, logs / "long-prompts.log", env=device_env(False), timeout=3600)
    try:
        return to_rows(json.loads(out.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        why = tail(logs / "long-prompts.log") or str(exc)
        return [Row(STEP, "Llama-3.1-8B shape", FAIL, f"exit status {rc}: {why}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="8B-shaped model at long prompts (child)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--sizes", default=",".join(map(str, llama8b.DEFAULT_SIZES)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = measure(args.model_dir, sizes, args.repeats)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
