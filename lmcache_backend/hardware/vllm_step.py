"""Step 6: vLLM's own engine with the connector, on a machine without vLLM: the bundle
(``make vllm-bundle``, carried in ``.cache/vllm-bundle``) is unpacked into a temporary folder and
one child (:mod:`.vllm_engine`) imports vLLM 0.26.0 from there and runs it: smoke (vLLM's
ExampleConnector, then this package's), agreement at ratio 1.0 against the same engine's full
prefill, TTFT at each size against full prefill. One row per part; a part that fails names what
is missing (an op, an import) in its row.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from lmcache_backend.hardware import vllm_bundle
from lmcache_backend.hardware.children import device_env, python_module, run_child, shell_line, tail
from lmcache_backend.hardware.table import DRY, FAIL, INFO, PASS, SKIPPED, Row

STEP = "vLLM engine"
CHILD = "lmcache_backend.hardware.vllm_engine"
#: the sizes of the step's timed prompts, tokens
DEFAULT_SIZES = (2000, 8000, 32000)
#: the child's limit, seconds: the whole device call must stay within 8 minutes
TIMEOUT = 390


def command(shape: str, sizes: list[int], repeats: int, out: Path, work: Path) -> list[str]:
    args = ["--shape", shape, "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    return python_module(CHILD, *args, "--json", str(out), "--work", str(work))


def _gib(x: float) -> str:
    return f"{x:.1f} GiB"


def row(result: dict, model: str) -> Row:
    """One child result as a table row."""
    part = result["part"]
    if not result["ok"] and "error" in result:
        return Row(STEP, part, FAIL, result["error"])
    if part.startswith("smoke"):
        started = f"engine up in {result['start_s']:.0f} s; " if "start_s" in result else ""
        return Row(
            STEP,
            f"{part} ({'tiny Llama' if 'Example' in part else model})",
            PASS,
            f"{started}one request, TTFT {1000 * result['ttft']:.0f} ms (vLLM's metrics)",
        )
    if part == "agreement":
        one, default = result["ratio 1.0"], result["default"]
        text = (
            f"{result['tokens']:,} tokens, {result.get('dtype', 'bfloat16')}, last-token logits "
            f"({one['vocab']:,}) against the same engine's full prefill: ratio 1.0 rel. error "
            f"{one['rel_err']:.1e} (limit {result.get('limit', 0.1):g}), KL "
            f"{one['kl']:.1e}, top-1 {'agrees' if one['top1_agrees'] else 'differs'}"
            f"{'' if one['blended'] else ', NOT blended: ' + str(one['why_not'])}; default ratio "
            f"rel. error {default['rel_err']:.1e}, KL {default['kl']:.1e}, top-1 "
            f"{'agrees' if default['top1_agrees'] else 'differs'}"
        )
        return Row(STEP, f"agreement, {model}", PASS if result["ok"] else FAIL, text)
    full, blend = result["full prefill"], result["CacheBlend"]
    low, high = blend["spread_ms"]
    why = f"; not blended: {', '.join(result['why_not'])}" if result["why_not"] else ""
    text = (
        f"TTFT {blend['ttft_ms']:.0f} ms = {blend['ttft_ms'] / full['ttft_ms']:.2f}x full "
        f"prefill's {full['ttft_ms']:.0f} ms (medians; blend {low:.0f}-{high:.0f} ms, full "
        f"{full['spread_ms'][0]:.0f}-{full['spread_ms'][1]:.0f} ms; {full['ttft_from']}); peak "
        f"{_gib(blend['peak_gib'])} (+{blend['extra_gib']:.2f}) against {_gib(full['peak_gib'])} "
        f"(+{full['extra_gib']:.2f}); {result['blended']} blended{why}"
    )
    return Row(STEP, f"{part}, {model}", PASS if result["ok"] else FAIL, text)


def run(logs: Path, bundle: str | None, sizes: list[int], repeats: int, dry_run: bool) -> list[Row]:
    """Unpack the bundle, run the child, one row per part."""
    where = vllm_bundle.bundle_dir(bundle)
    try:
        info = vllm_bundle.manifest(where)
    except FileNotFoundError as exc:
        return [Row(STEP, "every part", SKIPPED, str(exc))]
    model = "Llama-3.1-8B shape, dummy weights redrawn"
    out = logs / "vllm-engine.json"
    work = Path(tempfile.mkdtemp(prefix="vllm-step-"))
    cmd = command("llama-3.1-8b", sizes, repeats, out, work)
    size = f"bundle {where} ({info['total_bytes'] / (1 << 20):.1f} MiB, vLLM {info['vllm']})"
    if dry_run:
        print(f"  would unpack {size}\n  would run: PYTHONPATH=<unpacked> {shell_line(cmd)}")
        parts = ["smoke: ExampleConnector", "smoke: CacheBlendConnector", "agreement"]
        parts += [f"time: {s:,} tokens" for s in sizes]
        return [Row(STEP, p, DRY, DRY) for p in parts]
    mismatch = vllm_bundle.python_mismatch(info)
    if mismatch:
        return [Row(STEP, "every part", FAIL, mismatch)]
    site = vllm_bundle.unpack(where, work)
    print(f"  unpacked {size} into {site}", flush=True)
    env = vllm_bundle.child_env(site, device_env(False))
    rc = run_child(cmd, logs / "vllm-engine.log", env=env, timeout=TIMEOUT)
    try:
        results = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        why = tail(logs / "vllm-engine.log") or f"exit status {rc}"
        return [Row(STEP, "vLLM 0.26.0 from the bundle", FAIL, f"exit status {rc}: {why}")]
    rows = [row(r, model) for r in results]
    rows.append(Row(STEP, "bundle", INFO, f"{size}, Python {sys.version.split()[0]}"))
    return rows
