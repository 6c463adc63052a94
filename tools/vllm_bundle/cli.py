"""``python tools/build_vllm_bundle.py [--out DIR] [--wheel PATH] [--rehearsal]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import build, gpu_python, spec

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".cache" / "vllm-bundle"
REHEARSAL = ROOT / ".cache" / "vllm-rehearsal"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=BUNDLE, help=f"default: {BUNDLE}")
    parser.add_argument("--wheel", type=Path, help=f"{spec.VLLM_WHEEL} already on disk")
    parser.add_argument(
        "--rehearsal",
        action="store_true",
        help=f"build the CPU rehearsal's venv and wheels in {REHEARSAL} (needs the bundle)",
    )
    args = parser.parse_args(argv)
    if args.rehearsal:
        if not (args.out / "manifest.json").is_file():
            raise SystemExit(f"no bundle in {args.out}: build it first (make vllm-bundle)")
        python = gpu_python.build(REHEARSAL / "venv")
        have = set(gpu_python.closure(gpu_python.GPU_MACHINE_ROOTS))
        manifest = build.build_rehearsal(REHEARSAL, args.out, have)
        print(f"rehearsal: {python}, {len(manifest['dependencies'])} wheels in {REHEARSAL}")
        return 0
    manifest = build.build(args.out, args.wheel)
    mib = manifest["total_bytes"] / (1 << 20)
    print(
        f"bundle: {args.out} ({mib:.1f} MiB of {spec.CARRY_LIMIT >> 20}): vLLM "
        f"{spec.VLLM_VERSION}'s Python ({manifest['contents']['files']} files, "
        f"{manifest['contents']['left_out']} compiled/C++ files left out), stand-ins "
        f"{', '.join(manifest['contents']['stand_ins'])}, {len(manifest['dependencies'])} wheels"
    )
    return 0
