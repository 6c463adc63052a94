"""Step 3: the connector's worker-side blend at Llama-3.1-8B's shape, with no vLLM: time against
full prefill at ~8k and ~32k tokens, device memory, and agreement with full prefill on every
recorded cache form, by ``benchmarks/device_blend.py`` (a script of the checkout, run in a child).

A row fails when the blend at ratio 1.0 (every token recomputed) is farther from the model's
fp32 prefill than twice the bf16 full prefill is, or picks another next token, or when the child
fails; times, memory, the GPU profile (how busy the GPU is during the blend), the kernel launches
and host-device syncs of one request, the stage profile (each phase's fixed and per-token cost,
from the timed sizes) and the default ratio's and naive reuse's deviations are reported
(``info``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from lmcache_backend.hardware.children import device_env, repo_root, run_child, shell_line, tail
from lmcache_backend.hardware.table import DRY, FAIL, INFO, PASS, Row

STEP = "device blend"
SCRIPT = Path("benchmarks") / "device_blend.py"
_MODULE_NAME = "lmcache_backend_benchmark_device_blend"
GIB = 1 << 30
#: the ways the hits reach the GPU that the check times, the first the default
HOST_LOADS = "staged,direct"


def load_benchmark() -> ModuleType:
    """``benchmarks/device_blend.py`` of the checkout, as a module."""
    path = repo_root() / SCRIPT
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def command(sizes: list[int], repeats: int, out: Path) -> list[str]:
    args = ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats), "--json", str(out)]
    return [
        sys.executable, str(SCRIPT), *args, "--profile", "--count", "--host-load", HOST_LOADS,
    ]  # fmt: skip


def _agreement_row(entry: dict, bench: ModuleType) -> Row:
    ratio = entry["ratio"]
    label = {1.0: "1.0 (every token recomputed)", 0.0: "0 (naive reuse)"}.get(ratio, "default")
    case = f"{entry['tokens']:,} tokens, {entry['form']}, ratio {label}"
    numbers = (
        f"against the bf16 full prefill: K/V rel. error {entry['kv_rel_err']:.1e} (worst layer), "
        f"last-token logits {entry['logits_rel_err']:.1e}, KL {entry['kl']:.1e}, top-1 "
        f"{'agrees' if entry['top1_agrees'] else 'differs'}; "
        f"{entry['token_layer_fraction']:.0%} of token-layers"
    )
    if ratio != 1.0:
        return Row(STEP, case, INFO, numbers)
    factor = bench.AGREEMENT_FACTOR
    against_fp32 = (
        f"; against the fp32 prefill: K/V {entry['kv_err_fp32']:.1e}, logits "
        f"{entry['logits_err_fp32']:.1e} (the bf16 full prefill's own: "
        f"{entry['bf16_kv_err_fp32']:.1e}, {entry['bf16_logits_err_fp32']:.1e}; "
        f"allowed {factor:g}x)"
    )
    verdict = PASS if bench.agrees(entry) else FAIL
    return Row(STEP, case, verdict, numbers + against_fp32)


def _timing_rows(item: dict, first: bool = True) -> list[Row]:
    """Full prefill (for the first load mode timed) and the blend of one timed size."""
    case = f"{item['tokens']:,} tokens, {item['form']}"
    full = Row(
        STEP,
        f"{case}: full prefill (SDPA)",
        INFO,
        f"{item['full_ms']:.0f} ms; peak {item['full_peak_gib']:.1f} GiB, "
        f"+{item['full_extra_gib']:.2f} GiB over resting",
    )
    low, high = item["spread"]
    blend = Row(
        STEP,
        f"{case}: CacheBlend (blend + question), {item['host_load']} load",
        INFO,
        f"{item['blend_ms']:.0f} ms = {item['ratio']:.2f}x full prefill (medians of "
        f"{item['rounds']}; rounds {low:.2f}-{high:.2f}x), question {item['question_ms']:.0f} ms; "
        f"peak {item['blend_peak_gib']:.1f} GiB, +{item['blend_extra_gib']:.2f} GiB over resting; "
        f"{item['recompute_fraction']:.0%} recomputed, "
        f"{item['token_layer_fraction']:.0%} of token-layers",
    )
    return [full, blend] if first else [blend]


def _count_rows(item: dict, layers: int) -> list[Row]:
    """Launches and syncs of one request, per mode (the launch counter's)."""
    rows = []
    for mode in ("full prefill", "CacheBlend"):
        c = item[mode]
        syncs = f"{c['syncs']} host-device syncs"
        if "cuda_syncs" in c:
            syncs += f" ({c['cuda_syncs']} seen by torch's sync debug mode)"
        sites = ", ".join(f"{site} x{n}" for site, n in list(c["sync_sites"].items())[:4])
        rows.append(
            Row(
                STEP,
                f"{item['tokens']:,} tokens: {mode}, launches and syncs per request",
                INFO,
                f"{c['launches']} launches ({c['launches'] / layers:.0f} per layer; "
                f"{c['triton']} Triton), {syncs}" + (f"; most: {sites}" if sites else ""),
            )
        )
    return rows


def _stage_rows(profile: dict) -> list[Row]:
    """The fixed and per-token cost of each stage (from the timed sizes)."""
    return [
        Row(
            STEP,
            f"stage profile: {stage}",
            INFO,
            f"{cost['fixed_ms']:.1f} ms fixed + {cost['per_1k_tokens_ms']:.2f} ms per 1k tokens",
        )
        for stage, cost in profile.items()
    ]


def to_rows(result: dict, bench: ModuleType) -> list[Row]:
    rows = [_agreement_row(e, bench) for e in result["agreement"]]
    for item in result["timing"]:
        first = item.get("host_load") == result["timing"][0].get("host_load")
        rows += _timing_rows(bench.summary(item), first)
    for item in result.get("profile", []):
        for mode in ("full prefill", "CacheBlend"):
            p = item[mode]
            top = ", ".join(f"{name} {ms:.1f} ms" for name, ms in p["top"][:3])
            busy = p["kernel_ms"] / p["wall_ms"] if p["wall_ms"] else 0.0
            rows.append(
                Row(
                    STEP,
                    f"{item['tokens']:,} tokens: {mode}, under the profiler",
                    INFO,
                    f"wall {p['wall_ms']:.0f} ms, GPU kernels {p['kernel_ms']:.0f} ms in "
                    f"{p['kernels']} launches (GPU busy {busy:.0%} of the wall time); most GPU "
                    f"time: {top}",
                )
            )
    layers = int(result.get("shape_detail", {}).get("layers", 1))
    for item in result.get("counts", []):
        rows += _count_rows(item, layers)
    rows += _stage_rows(result.get("stage_profile", {}))
    return rows


def run(logs: Path, sizes: list[int], repeats: int, dry_run: bool) -> list[Row]:
    """On the device run the child; dry: load the benchmark, build its prompts, find its forms."""
    bench = load_benchmark()
    out = logs / "device-blend.json"
    cmd = command(sizes, repeats, out)
    if dry_run:
        args = bench.parse_args(cmd[2:])
        for form in args.forms.split(","):
            bench.find_form(form)
        shape = bench.SHAPES[args.shape]
        prompts = {s: bench.rag_prompts(s, repeats + 1, shape.vocab, seed=s) for s in sizes}
        print(f"  would run: {shell_line(cmd)}")
        forms = args.forms.split(",")
        rows = [
            Row(STEP, f"{len(prompts[sizes[0]][1][0]):,} tokens, {form}, ratio {r}", DRY, DRY)
            for form in forms
            for r in ("1.0", "default", "0")
            if r != "0" or form == forms[0]
        ]
        loads = [f"CacheBlend (blend + question), {m} load" for m in HOST_LOADS.split(",")]
        timed = [
            Row(STEP, f"{len(prompts[s][1][0]):,} tokens, {bench.FORMS[0]}: {mode}", DRY, DRY)
            for s in sizes
            for mode in ["full prefill (SDPA)", *loads]
        ]
        counted = [
            Row(STEP, f"{len(prompts[s][1][0]):,} tokens: {mode}", DRY, DRY)
            for s in sizes
            for mode in (
                "full prefill, launches and syncs per request",
                "CacheBlend, launches and syncs per request",
            )
        ]
        return rows + timed + counted
    out.unlink(missing_ok=True)
    rc = run_child(cmd, logs / "device-blend.log", env=device_env(False), timeout=1800)
    try:
        return to_rows(json.loads(out.read_text(encoding="utf-8")), bench)
    except (OSError, ValueError, KeyError) as exc:
        why = tail(logs / "device-blend.log") or str(exc)
        return [Row(STEP, "Llama-3.1-8B shape", FAIL, f"exit status {rc}: {why}")]
