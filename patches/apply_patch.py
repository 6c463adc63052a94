"""Patch, check or revert vllm-ascend's NPU worker for CacheBlend.

Usage (``lmcache-backend apply-patch`` takes the same arguments)::

    python patches/apply_patch.py                 # patch the installed vllm-ascend
    python patches/apply_patch.py --path FILE     # patch FILE instead
    python patches/apply_patch.py --check         # 0 patched, 1 not patched, 2 not understood
    python patches/apply_patch.py --dry-run       # print the unified diff, change nothing
    python patches/apply_patch.py --revert        # restore the original bytes

Exit codes: 0 success (for ``--check``: patched); 1 ``--check`` found the file unpatched, or the
file could not be read or written; 2 the file is missing or not a worker this tool understands
(also argparse usage errors). Nothing is written unless the patched file compiles, starts KV
transfer exactly once, and reverts to the original bytes. What is patched, and why, is in
``vllm_ascend_worker.py`` beside this file and in ``docs/patching.md``.

The installed vllm-ascend is located without importing it (importing ``vllm_ascend`` pulls in
torch_npu and vLLM, which need an NPU driver).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import importlib.util
import os
import re
import stat
import sys
import tempfile
import tokenize
from pathlib import Path

if __package__:
    from . import vllm_ascend_worker as worker_patch
else:  # run as a plain script from a checkout: this folder is sys.path[0]
    import vllm_ascend_worker as worker_patch  # type: ignore[no-redef]

    # the checkout's package, where no installed one is importable (it needs no torch here)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from lmcache_backend.compat.ascend import PATCH_CHECKED  # noqa: E402

# vllm-ascend releases whose worker this tool was checked against. Older releases predate the
# V1 worker layout and are refused; newer ones are patched if their structure is understood.
OLDEST_CHECKED = PATCH_CHECKED[0]
NEWEST_CHECKED = PATCH_CHECKED[-1]
# worker_v1.py holds the V1 worker up to 0.11.0 (0.9.1 also ships the V0 worker as worker.py);
# from 0.13.0 the V1 worker is worker.py.
WORKER_FILES = ("worker/worker_v1.py", "worker/worker.py")

EXIT_OK = 0
EXIT_NOT_PATCHED = 1
EXIT_IO_ERROR = 1
EXIT_UNSUPPORTED = 2


class ToolError(Exception):
    """A failure reported to the user with an exit code."""

    def __init__(self, message: str, code: int = EXIT_UNSUPPORTED) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------
# Locating the installed worker


def _vllm_ascend_dirs() -> list[Path]:
    """Package folders of ``vllm_ascend`` on ``sys.path``, found without importing it.

    ``find_spec`` of a top-level name only runs the finders; it does not execute the package.
    """
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec("vllm_ascend")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p) for p in spec.submodule_search_locations]
    dirs += [Path(entry) / "vllm_ascend" for entry in sys.path if entry]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def _dist_dirs() -> list[Path]:
    """The ``vllm_ascend`` folder recorded by the installed distribution's file list."""
    try:
        dist = importlib.metadata.distribution("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return []
    for f in dist.files or []:
        if f.as_posix() == "vllm_ascend/__init__.py":
            return [Path(str(dist.locate_file(f))).parent]
    return []


def installed_version() -> str | None:
    """The installed vllm-ascend version, or None."""
    try:
        return importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(x or 0) for x in match.groups()) if match else ()


def find_installed_worker() -> Path:
    """The V1 worker file of the vllm-ascend visible to this interpreter."""
    version = installed_version()
    if version and _version_tuple(version) < _version_tuple(OLDEST_CHECKED):
        raise ToolError(f"vllm-ascend {version} is older than {OLDEST_CHECKED} and not supported")
    for pkg in _vllm_ascend_dirs() + _dist_dirs():
        for rel in WORKER_FILES:
            if (pkg / rel).is_file():
                return pkg / rel
    raise ToolError(
        "vllm-ascend is not installed for this Python "
        f"({sys.executable}); run this tool with vllm-ascend's Python or pass --path FILE"
    )


# --------------------------------------------------------------------------------------------
# Reading and writing


def read_source(path: Path) -> tuple[str, str]:
    """``(text, encoding)`` of a Python file, honouring a coding cookie; newlines untouched."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ToolError(f"{path}: no such file") from exc
    except OSError as exc:
        raise ToolError(f"{path}: cannot read: {exc}", EXIT_IO_ERROR) from exc
    try:
        encoding, _ = tokenize.detect_encoding(iter(raw.splitlines(keepends=True)).__next__)
        return raw.decode(encoding), encoding
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise ToolError(f"{path}: not a Python source file ({exc})") from exc


def write_atomic(path: Path, text: str, encoding: str) -> None:
    """Replace ``path`` with ``text`` in one step, keeping its permission bits.

    A temporary file in the same folder is renamed over the original, so a reader (or a crash)
    sees either the old or the new file, never half of one.
    """
    data = text.encode(encoding)
    mode = stat.S_IMODE(path.stat().st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unified_diff(old: str, new: str, path: Path) -> str:
    """A unified diff of two versions of ``path``."""
    return "".join(
        difflib.unified_diff(
            worker_patch.split_lines(old),
            worker_patch.split_lines(new),
            fromfile=f"{path} (original)",
            tofile=f"{path} (patched)",
        )
    )


# --------------------------------------------------------------------------------------------
# Commands


def _describe(plan: worker_patch.Analysis) -> str:
    if plan.mode == "move":
        return (
            f"registers the model at the end of {plan.class_name}.load_model() and moves "
            f"{plan.kv_call_source} there from {plan.kv_method}()"
        )
    return (
        f"registers the model at the end of {plan.class_name}.load_model(); KV transfer already "
        f"starts later, in {plan.kv_method}() ({plan.kv_call_source}), and is left alone"
    )


def cmd_check(path: Path) -> int:
    text, _ = read_source(path)
    state, plan = worker_patch.status(text)
    if state == "patched":
        print(f"patched: {path}")
        if worker_patch.apply(text, str(path)) != text:
            print("note: patched by another lmcache-backend version; apply again to update")
        return EXIT_OK
    print(f"not patched: {path} (applying {_describe(plan)})")
    return EXIT_NOT_PATCHED


def cmd_apply(path: Path, dry_run: bool) -> int:
    text, encoding = read_source(path)
    _, plan = worker_patch.status(text)
    new = worker_patch.apply(text, str(path))
    if new == text:
        print(f"already patched: {path}")
        return EXIT_OK
    if dry_run:
        sys.stdout.write(unified_diff(text, new, path))
        return EXIT_OK
    _write(path, new, encoding)
    print(f"patched: {path}\n  {_describe(plan)}\n  undo with --revert")
    return EXIT_OK


def cmd_revert(path: Path, dry_run: bool) -> int:
    text, encoding = read_source(path)
    original = worker_patch.revert(text)
    if original == text:
        print(f"not patched, nothing to revert: {path}")
        return EXIT_OK
    if dry_run:
        sys.stdout.write(unified_diff(text, original, path))
        return EXIT_OK
    _write(path, original, encoding)
    print(f"reverted: {path}")
    return EXIT_OK


def _write(path: Path, text: str, encoding: str) -> None:
    try:
        write_atomic(path, text, encoding)
    except OSError as exc:
        raise ToolError(f"{path}: cannot write: {exc}", EXIT_IO_ERROR) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-backend apply-patch",
        description="Patch vllm-ascend's NPU worker so that CacheBlend finds the loaded model: "
        "register it at the end of load_model and start KV transfer after that.",
    )
    parser.add_argument(
        "--path", type=Path, help="worker file to patch (default: the installed vllm-ascend's)"
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--check",
        action="store_true",
        help="exit 0 if patched, 1 if not patched, 2 if the file is not understood",
    )
    action.add_argument("--revert", action="store_true", help="restore the original file")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the unified diff, change nothing"
    )
    return parser


def _target(path: Path | None) -> Path:
    if path is not None:
        return path
    found = find_installed_worker()
    version = installed_version()
    print(f"vllm-ascend {version or '(version unknown)'}: {found}")
    if version and _version_tuple(version) > _version_tuple(NEWEST_CHECKED):
        print(f"note: newer than {NEWEST_CHECKED}, the newest release checked; going by structure")
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    if args.check and args.dry_run:
        build_parser().error("--check and --dry-run exclude each other")
    where = str(args.path or "the installed vllm-ascend worker")
    try:
        path = _target(args.path)
        where = str(path)
        if args.check:
            return cmd_check(path)
        if args.revert:
            return cmd_revert(path, args.dry_run)
        return cmd_apply(path, args.dry_run)
    except worker_patch.UnsupportedWorker as exc:
        print(
            f"error: {where} is not a vllm-ascend worker this tool understands: {exc}",
            file=sys.stderr,
        )
        return EXIT_UNSUPPORTED
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
