"""The command line: fetch each release wanted, record it, write its fixture and the index."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .ascend import record_ascend
from .fetch import fetch
from .output import fixture_name, write_index, write_json
from .releases import RELEASES
from .sources import Sources
from .vllm_record import record_vllm

REPO = Path(__file__).resolve().parents[2]
DESCRIPTION = (
    "Record what each vLLM / vllm-ascend release hands a KV connector, from the released packages."
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="record_engine_contracts.py", description=DESCRIPTION)
    ap.add_argument("--out", type=Path, default=REPO / "tests/fixtures/engine_contracts")
    ap.add_argument(
        "--cache",
        type=Path,
        default=REPO / ".cache/engine-src",
        help="slim source zips, one per release (git-ignored)",
    )
    ap.add_argument(
        "--tmp",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where a wheel is downloaded before it is sliced and deleted",
    )
    ap.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help="read wheels/sdists from here instead of downloading",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        help="PACKAGE==VERSION (repeatable); default: every release",
    )
    args = ap.parse_args(argv)

    wanted = [(p, v) for p, versions in RELEASES.items() for v in versions]
    if args.only:
        wanted = [tuple(o.split("==", 1)) for o in args.only]  # type: ignore[misc]
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for package, version in wanted:
        try:
            slim = fetch(package, version, args.cache, args.wheel_dir, args.tmp)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other releases
            print(f"{package}=={version}: {exc}", file=sys.stderr)
            failed.append(f"{package}=={version}")
            continue
        s = Sources(slim)
        data = record_vllm(s, version) if package == "vllm" else record_ascend(s, version)
        write_json(args.out / fixture_name(package, version), data)
        print(f"{package}=={version}: {fixture_name(package, version)}")
    write_index(args.out)
    return 1 if failed else 0
