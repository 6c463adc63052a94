"""The ``lmcache-backend`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _demo(args: argparse.Namespace) -> int:
    from lmcache_backend import demos

    return demos.main(args)


def _serve(args: argparse.Namespace) -> int:
    from lmcache_backend.integration.vllm.serving import serve

    return serve.main(args, args.vllm_args)


def _bench(args: argparse.Namespace) -> int:
    from lmcache_backend import bench

    return bench.main(args)


def _model_path(args: argparse.Namespace) -> int:
    from lmcache_backend.data.embedded import embedded_model_path

    try:
        print(embedded_model_path(args.name))
    except (KeyError, FileNotFoundError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        print(f"lmcache-backend model-path: {message}", file=sys.stderr)
        return 1
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.docs:
        from lmcache_backend.settings import docs

        return docs.run(args)
    from lmcache_backend.config import load_config

    print(load_config().describe())
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from lmcache_backend.commands import doctor

    return doctor.main(args)


def _verify(args: argparse.Namespace) -> int:
    from lmcache_backend.commands import verify

    return verify.main(args)


def _hardware_check(args: argparse.Namespace) -> int:
    from lmcache_backend.hardware import command

    return command.main(args)


def _apply_patch(args: argparse.Namespace) -> int:
    from lmcache_backend.patches import apply_patch

    return apply_patch.main(args.patch_args)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the message and where the usage is, not the usage."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (usage: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from lmcache_backend.version import __version__

    parser = _Parser(prog="lmcache-backend", description=__doc__)
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level; a mistake's one-line error comes with its traceback",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-backend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from lmcache_backend import demos

    p = sub.add_parser(
        "demo", help="RAG chats through vLLM's server: CacheBlend vs full prefill (TTFT, answers)"
    )
    demos.add_arguments(p)
    p.set_defaults(func=_demo)

    from lmcache_backend import bench

    p = sub.add_parser("bench", help="KV-reuse strategies side by side on RAG prompts")
    bench.add_arguments(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser(
        "serve",
        help="vllm serve with CacheBlendConnector (vllm serve options pass on; "
        "serve --help lists both)",
        add_help=False,
    )
    p.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="[MODEL] [--stats-file PATH] [vllm serve options]: lmcache-backend serve --help",
    )
    p.set_defaults(func=_serve)

    p = sub.add_parser("model-path", help="print a folder holding an embedded model")
    p.add_argument("name", nargs="?", default=None, help="smollm2 (default) or gemma3-270m")
    p.set_defaults(func=_model_path)

    p = sub.add_parser("config", help="print the effective configuration and its sources")
    p.add_argument(
        "--docs",
        action="store_true",
        help="instead: rewrite the key tables of the README and docs/ from the settings registry",
    )
    from lmcache_backend.settings import docs as settings_docs

    settings_docs.add_arguments(p)
    p.set_defaults(func=_config)

    p = sub.add_parser("doctor", help="versions, matrix row, backend and hooks in use")
    from lmcache_backend.commands import doctor

    doctor.add_arguments(p)
    p.set_defaults(func=_doctor)

    from lmcache_backend.commands import ingest, verify

    ingest.register(sub)
    p = sub.add_parser("verify", help="check that blending is exact on a model (pass/fail)")
    verify.add_arguments(p)
    p.set_defaults(func=_verify)

    from lmcache_backend.hardware import command as hardware_check

    p = sub.add_parser(
        "hardware-check",
        help="on a CUDA GPU or Ascend NPU: device tests, kernel timings, verify per attention "
        "backend, an 8B config at 8k/32k tokens; appends a table to docs/hardware.md",
    )
    hardware_check.add_arguments(p)
    p.set_defaults(func=_hardware_check)

    p = sub.add_parser(
        "apply-patch", help="patch vllm-ascend's worker (see docs/patching.md)", add_help=False
    )
    p.add_argument(
        "patch_args",
        nargs=argparse.REMAINDER,
        help="--check | --revert | --dry-run, --path FILE: lmcache-backend apply-patch --help",
    )
    p.set_defaults(func=_apply_patch)
    return parser


def _serve_args(rest: list[str], verbose: bool = False) -> argparse.Namespace:
    model = rest[0] if rest and not rest[0].startswith("-") else None
    rest = rest[1:] if model is not None else list(rest)
    stats_file = None
    vllm_args: list[str] = []
    i = 0
    while i < len(rest):
        if rest[i] == "--stats-file" and i + 1 < len(rest):
            stats_file = rest[i + 1]
            i += 2
            continue
        if rest[i].startswith("--stats-file="):
            stats_file = rest[i].split("=", 1)[1]
        else:
            vllm_args.append(rest[i])
        i += 1
    return argparse.Namespace(
        command="serve",
        verbose=verbose,
        model=model,
        stats_file=stats_file,
        vllm_args=vllm_args,
        func=_serve,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # argparse's REMAINDER does not capture leading options (apply-patch --path FILE): hand the
    # patcher its arguments untouched.
    if "apply-patch" in argv and set(argv[: argv.index("apply-patch")]) <= {"-v", "--verbose"}:
        from lmcache_backend.patches import apply_patch

        return apply_patch.main(argv[argv.index("apply-patch") + 1 :])
    if "serve" in argv and set(argv[: argv.index("serve")]) <= {"-v", "--verbose"}:
        # vllm serve's options pass through untouched; only MODEL and --stats-file are ours
        i = argv.index("serve")
        args = _serve_args(argv[i + 1 :], verbose=bool(argv[:i]))
    else:
        args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Two cores fight over more threads than they have (runs got ~20x slower); cap by default.
    from lmcache_backend.settings.writer import export

    export(defaults={"omp_num_threads": os.cpu_count() or 1})
    try:
        return args.func(args)
    except Exception as exc:  # a user's mistake: one line; anything else: its traceback
        from lmcache_backend.errors import USAGE_EXIT, report

        if report(args.command, exc, args.verbose):
            return USAGE_EXIT
        raise


if __name__ == "__main__":
    sys.exit(main())
