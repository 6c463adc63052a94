"""The GPU test machine's Python, emulated on this machine for the CPU rehearsal.

The GPU machine has torch, Triton, transformers and pytest (with their dependencies) and this
package installed in place, nothing else. The rehearsal must see exactly that much, or a start-up
dependency missing from the bundle would be found in this checkout's ``.venv`` (which has
everything vLLM's CPU build needs) and the GPU run would be the first to miss it. So the
rehearsal runs in a venv of its own whose ``site-packages`` holds links to those distributions
of the running interpreter's environment, and to nothing else.

The versions are this machine's (torch's CPU build, Python 3.11), not the GPU machine's: the
rehearsal tests that vLLM's Python runs against them, the bundle's dependency list is the same.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: what the GPU test machine has installed, with their dependencies
GPU_MACHINE_ROOTS = ("torch", "triton", "transformers", "pytest", "lmcache-backend")


def _requirements(dist: md.Distribution) -> list[str]:
    """The names ``dist`` depends on where installed here (no extras)."""
    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        names.append(canonicalize_name(req.name))
    return names


def installed() -> dict[str, md.Distribution]:
    """The distributions of this interpreter's environment, by canonical name."""
    return {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}


def closure(roots: tuple[str, ...], *, skip: frozenset[str] = frozenset()) -> list[str]:
    """``roots`` and everything they depend on, as installed here (canonical names, sorted).

    ``skip``: names left out with what only they bring (lmcache-backend's own dependencies that
    the GPU machine was never asked to have, e.g. vLLM's CPU build)."""
    have = installed()
    todo = [canonicalize_name(r) for r in roots]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name in skip or name not in have:
            continue
        seen.add(name)
        todo += _requirements(have[name])
    return sorted(seen)


def top_level_entries(dist: md.Distribution) -> set[str]:
    """The names directly inside ``site-packages`` that ``dist`` installed (packages, modules,
    extension files, its ``.dist-info``, ``.pth`` files)."""
    entries = set()
    for f in dist.files or []:
        parts = Path(str(f)).parts
        if parts and parts[0] != "..":
            entries.add(parts[0])
    return entries


def site_packages(venv: Path) -> Path:
    return (
        venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    )


def build(venv: Path) -> Path:
    """Create (or refresh) ``venv`` with links to the GPU machine's distributions; its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = site_packages(venv)
    for old in site.iterdir():
        if old.is_symlink():
            old.unlink()
    have = installed()
    # lmcache-backend's own requirements are the GPU machine's only where they are the roots';
    # the package is installed there with --no-deps
    own = closure(("lmcache-backend",))
    shared = set(closure(GPU_MACHINE_ROOTS[:-1]))
    names = sorted(shared | {"lmcache-backend"})
    source_site = Path(md.distribution("torch").locate_file(""))
    for name in names:
        for entry in sorted(top_level_entries(have[name])):
            target = source_site / entry
            if target.exists() and not (site / entry).exists():
                os.symlink(target, site / entry)
    (venv / "gpu-machine-distributions.txt").write_text(
        "\n".join(f"{n}=={have[n].version}" for n in names) + "\n", encoding="utf-8"
    )
    del own
    return python
