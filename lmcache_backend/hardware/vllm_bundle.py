"""The vLLM runtime bundle where the check runs: find it, unpack it into a temporary folder, and
the environment a child gets to import vLLM from there (``PYTHONPATH``; nothing is installed).

The bundle is built by ``make vllm-bundle`` (``tools/build_vllm_bundle.py``) into
``.cache/vllm-bundle/``: vLLM's Python files in one zip, its start-up dependencies as wheels (a
wheel is a zip: unpacking it is installing it, less the scripts), ``manifest.json``.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

from lmcache_backend.hardware.children import repo_root
from lmcache_backend.settings import writer as settings_writer

#: where ``make vllm-bundle`` writes the bundle, under the checkout
DEFAULT_DIR = Path(".cache") / "vllm-bundle"


def bundle_dir(given: str | None = None) -> Path:
    return Path(given) if given else repo_root() / DEFAULT_DIR


def manifest(bundle: Path) -> dict:
    """The bundle's manifest.

    Raises:
        FileNotFoundError: no bundle there (the message says how to build and carry one).
    """
    path = bundle / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no vLLM bundle at {bundle}: build it with `make vllm-bundle` on a machine with "
            "PyPI and carry .cache/vllm-bundle (see docs/hardware.md)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def python_mismatch(info: dict) -> str | None:
    """Why this interpreter cannot load the bundle's compiled wheels, or None."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if info["python"] != here:
        return f"the bundle's wheels are for Python {info['python']}, this is Python {here}"
    return None


def unpack(
    bundle: Path, dest: Path, wheels: Path | None = None, python_zip: Path | None = None
) -> Path:
    """Unpack vLLM's Python files and the wheels (default: the bundle's own; the CPU rehearsal
    passes wheels built for its interpreter) into ``dest/site``; that folder."""
    info = manifest(bundle)
    site = dest / "site"
    site.mkdir(parents=True, exist_ok=True)
    zips = [python_zip or bundle / info["python_zip"]]
    zips += sorted((wheels or bundle / info["wheels"]).glob("*.whl"))
    for path in zips:
        with zipfile.ZipFile(path) as zf:
            zf.extractall(site)
    return site


def child_env(site: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the unpacked bundle first on
    ``PYTHONPATH``: a child imports vLLM and its dependencies from there before anything
    installed."""
    env = settings_writer.child_env(base)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(site) + (os.pathsep + rest if rest else "")
    return env
