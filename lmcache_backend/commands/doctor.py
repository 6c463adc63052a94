"""``lmcache-backend doctor``: what is installed, which matrix row applies, what is active.

Each section is a function returning ``(title, [(label, value), ...])``; integrations add theirs
to :data:`SECTIONS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

Section = Callable[[], tuple[str, list[tuple[str, str]]]]


def _versions_section() -> tuple[str, list[tuple[str, str]]]:
    from lmcache_backend import __version__
    from lmcache_backend.compat import detect_versions, matrix_row

    v = detect_versions()
    # vllm-ascend rows apply without LMCache; LMCache rows are keyed by vLLM and LMCache alone
    ascend = v.vllm_ascend if v.lmcache is None else None
    row = matrix_row(v.vllm, v.lmcache, ascend) if v.vllm else None
    return "versions", [
        ("lmcache-backend", __version__),
        ("torch", v.torch or "not installed"),
        ("vllm", v.vllm or "not installed"),
        ("vllm-ascend", v.vllm_ascend or "not installed"),
        ("lmcache", v.lmcache or "not installed"),
        ("matrix row", row.describe() if row else "none (see docs: version matrix)"),
    ]


def _backend_section() -> tuple[str, list[tuple[str, str]]]:
    from lmcache_backend.config import load_config
    from lmcache_backend.device import detect_platform
    from lmcache_backend.ops import BackendUnavailable, get_ops

    config = load_config()
    try:
        ops = get_ops(config.backend)
        served = ", ".join(f"{op}={by}" for op, by in ops.served_by)
        backend = f"{ops.name} ({served})"
    except (BackendUnavailable, ValueError) as exc:
        backend = f"unavailable: {exc}"
    return "backend", [
        ("platform", detect_platform()),
        ("backend setting", config.backend),
        ("ops in use", backend),
        ("enable_blending", str(config.enable_blending)),
    ]


def _integration_section(module: str, title: str) -> Section:
    """A section provided by ``module.doctor_section()``, or a line saying it is absent."""

    def section() -> tuple[str, list[tuple[str, str]]]:
        import importlib

        try:
            provider = importlib.import_module(module).doctor_section
        except (ImportError, AttributeError) as exc:
            return title, [("status", f"not available ({exc})")]
        return provider()

    return section


SECTIONS: list[Section] = [
    _versions_section,
    _backend_section,
    _integration_section("lmcache_backend.integration.vllm", "vllm"),
    _integration_section("lmcache_backend.integration.lmcache", "lmcache"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm",
        metavar="VERSION",
        help="instead of what is installed: what the connector would do with this vLLM release",
    )
    parser.add_argument("--vllm-ascend", metavar="VERSION", help="with --vllm: on vllm-ascend")
    parser.add_argument(
        "--platform",
        choices=("cpu", "cuda", "npu", "rocm", "xpu"),
        help="with --vllm: the platform (default: cuda, or npu with --vllm-ascend)",
    )


def _check_version(flag: str, value: str) -> None:
    from packaging.version import InvalidVersion

    from lmcache_backend.compat.versions import parse_version
    from lmcache_backend.errors import UsageError

    try:
        parse_version(value)
    except InvalidVersion as exc:
        raise UsageError(f"{flag} {exc}") from None


def main(args: argparse.Namespace | None = None) -> int:
    """Print the sections.

    Raises:
        UsageError: ``--vllm`` or ``--vllm-ascend`` is not a version.
    """
    vllm = getattr(args, "vllm", None)
    for flag, value in (("--vllm", vllm), ("--vllm-ascend", getattr(args, "vllm_ascend", None))):
        if value is not None:
            _check_version(flag, value)
    if vllm:
        from lmcache_backend.integration.vllm import what_if_section

        ascend = getattr(args, "vllm_ascend", None)
        platform = getattr(args, "platform", None) or ("npu" if ascend else "cuda")
        sections: list[Section] = [lambda: what_if_section(vllm, platform, ascend)]
    else:
        sections = SECTIONS
    for section in sections:
        title, rows = section()
        print(f"[{title}]")
        width = max((len(label) for label, _ in rows), default=0)
        for label, value in rows:
            print(f"  {label:<{width}}  {value}")
    return 0
