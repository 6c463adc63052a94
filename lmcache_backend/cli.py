"""The ``lmcache-backend`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _demo(args: argparse.Namespace) -> int:
    from lmcache_backend import demo

    return demo.main(args)


def _bench(args: argparse.Namespace) -> int:
    from lmcache_backend import bench

    return bench.main(args)


def _model_path(args: argparse.Namespace) -> int:
    from lmcache_backend.embedded import embedded_model_path

    print(embedded_model_path())
    return 0


def _config(args: argparse.Namespace) -> int:
    from lmcache_backend.config import load_config

    print(load_config().describe())
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from lmcache_backend import doctor

    return doctor.main(args)


def _verify(args: argparse.Namespace) -> int:
    from lmcache_backend import verify

    return verify.main(args)


def _apply_patch(args: argparse.Namespace) -> int:
    from lmcache_backend.patches import apply_patch

    return apply_patch.main(args.patch_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-backend", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    from lmcache_backend import demo

    p = sub.add_parser("demo", help="CacheBlend vs full prefill on the embedded model")
    demo.add_arguments(p)
    p.set_defaults(func=_demo)

    from lmcache_backend import bench

    p = sub.add_parser("bench", help="KV-reuse strategies side by side on RAG prompts")
    bench.add_arguments(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("model-path", help="print a folder holding the embedded model")
    p.set_defaults(func=_model_path)

    p = sub.add_parser("config", help="print the effective configuration and its sources")
    p.set_defaults(func=_config)

    p = sub.add_parser("doctor", help="versions, matrix row, backend and hooks in use")
    p.set_defaults(func=_doctor)

    from lmcache_backend import verify

    p = sub.add_parser("verify", help="check that blending is exact on a model (pass/fail)")
    verify.add_arguments(p)
    p.set_defaults(func=_verify)

    p = sub.add_parser(
        "apply-patch", help="patch vllm-ascend's worker (see docs/patching.md)", add_help=False
    )
    p.add_argument("patch_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_apply_patch)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # argparse's REMAINDER does not capture leading options (apply-patch --path FILE): hand the
    # patcher its arguments untouched.
    if "apply-patch" in argv and set(argv[: argv.index("apply-patch")]) <= {"-v", "--verbose"}:
        from lmcache_backend.patches import apply_patch

        return apply_patch.main(argv[argv.index("apply-patch") + 1 :])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Two cores fight over more threads than they have (runs got ~20x slower); cap by default.
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
