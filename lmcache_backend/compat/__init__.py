"""The version matrix: which vLLM / vllm-ascend / LMCache combinations CacheBlend supports.

Three kinds of rows: the LMCache-Ascend guide's table (vLLM 0.9.2 to 0.11.0 with LMCache 0.3.3 to
0.3.12, kept as published), this package's own connector without LMCache (one row per code path
of :mod:`lmcache_backend.compat.vllm`, a range of vLLM releases), and vllm-ascend releases with
the vLLM they pin (:mod:`lmcache_backend.compat.ascend`). What runs is decided by the gate,
:mod:`lmcache_backend.compat.gate`. Versions are read from package metadata, never by importing
the packages.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lmcache_backend.compat.ascend import ASCEND_RELEASES
from lmcache_backend.compat.versions import (
    UnsupportedVersions,
    Versions,
    detect_versions,
    release,
    vkey,
)
from lmcache_backend.compat.vllm import CHECKED_SUMMARY, PROFILES, VERIFIED_ON_ENGINE


class Status(str, Enum):
    """A row's standing: ``stable`` (run on a real engine, or published so by LMCache),
    ``checked`` (runs; checked without a GPU or NPU engine: its source contract and the
    connector's path on CPU tensors shaped as the release hands its cache over), or refused."""

    STABLE = "stable"
    CHECKED = "source contract + CPU-tensor path"
    UNSUPPORTED = "unsupported"
    CONFLICT = "conflict"

    @property
    def runs(self) -> bool:
        return self in (Status.STABLE, Status.CHECKED)


@dataclass(frozen=True)
class MatrixRow:
    """One row of the matrix.

    Attributes:
        vllm: the vLLM release, or the first of a range of releases (``vllm_last``).
        lmcache: the LMCache release; None for this package's own, LMCache-free rows.
        status: stable, checked (without an engine), unsupported or conflicting.
        note: how the row is verified, or what to install instead.
        vllm_last: the last release of the range starting at ``vllm`` (None: one release).
        vllm_ascend: the vllm-ascend release of an NPU row (``vllm`` is the one it pins).
    """

    vllm: str
    lmcache: str | None
    status: Status
    note: str = ""
    vllm_last: str | None = None
    vllm_ascend: str | None = None

    def covers(self, vllm: str) -> bool:
        """Whether the release core of ``vllm`` lies in this row's vLLM range."""
        return vkey(self.vllm) <= vkey(vllm) <= vkey(self.vllm_last or self.vllm)

    def describe(self) -> str:
        span = f"{self.vllm}-{self.vllm_last}" if self.vllm_last else self.vllm
        ascend = f" + vllm-ascend {self.vllm_ascend}" if self.vllm_ascend else ""
        lm = f"+ LMCache {self.lmcache}" if self.lmcache else "without LMCache"
        text = f"vLLM {span}{ascend} {lm}: {self.status.value}"
        return f"{text} ({self.note})" if self.note else text


_LMCACHE_ROWS: tuple[MatrixRow, ...] = (
    MatrixRow("0.9.2", "0.3.3", Status.STABLE, "production ready"),
    MatrixRow("0.9.2", "0.3.7", Status.STABLE, "production ready"),
    MatrixRow("0.10.0", "0.3.7", Status.UNSUPPORTED, "install LMCache 0.3.12"),
    MatrixRow("0.11.0", "0.3.7", Status.UNSUPPORTED, "install LMCache 0.3.12"),
    MatrixRow("0.9.2", "0.3.12", Status.CONFLICT, "version mismatch; use LMCache 0.3.3 or 0.3.7"),
    MatrixRow("0.10.0", "0.3.12", Status.STABLE, "production ready"),
    MatrixRow("0.11.0", "0.3.12", Status.STABLE, "production ready"),
)


def _engine_rows() -> tuple[MatrixRow, ...]:
    """Releases run on a real engine first (an exact row wins over the range holding it): stable
    on the platforms named, checked on the others; then one row per code path and the
    vllm-ascend releases, checked without an engine."""
    rows = []
    for v, how in VERIFIED_ON_ENGINE.items():
        note = f"{'; '.join(how.values())}; other platforms: {Status.CHECKED.value}"
        rows.append(MatrixRow(v, None, Status.STABLE, note))
    for p in PROFILES:
        cpu = "CPU: source contract only" if p.has_cpu_path else "no CPU code path"
        last = p.last if p.last != p.first else None
        note = f"{CHECKED_SUMMARY}; {cpu}"
        rows.append(MatrixRow(p.first, None, Status.CHECKED, note, vllm_last=last))
    for a in ASCEND_RELEASES:
        status = Status.CHECKED if a.supported else Status.UNSUPPORTED
        note = a.note or "Ascend-shaped caches, torch-npu emulated"
        rows.append(MatrixRow(a.vllm, None, status, note, vllm_ascend=a.version))
    return tuple(rows)


MATRIX: tuple[MatrixRow, ...] = _LMCACHE_ROWS + _engine_rows()


def matrix_row(
    vllm: str | None, lmcache: str | None, vllm_ascend: str | None = None
) -> MatrixRow | None:
    """The row for this combination (release cores compared), or None when the matrix has none.

    ``vllm_ascend`` selects the NPU rows; without it only rows without vllm-ascend match.
    """
    v, lm, asc = release(vllm), release(lmcache), release(vllm_ascend)
    if v is None:
        return None
    for row in MATRIX:
        if release(row.lmcache) == lm and release(row.vllm_ascend) == asc and row.covers(v):
            return row
    return None


def supported_rows(with_lmcache: bool) -> list[MatrixRow]:
    """The rows that run with LMCache, or this package's own vLLM rows (no vllm-ascend)."""
    return [
        r
        for r in MATRIX
        if r.status.runs and (r.lmcache is not None) == with_lmcache and r.vllm_ascend is None
    ]


def check_supported(vllm: str | None, lmcache: str | None, force: bool = False) -> MatrixRow | None:
    """Return the row that runs this combination; raise :class:`UnsupportedVersions` otherwise.

    With ``force`` a combination outside the matrix is allowed (returns None); a row marked
    unsupported or conflicting is refused even then.
    """
    row = matrix_row(vllm, lmcache)
    if row is not None and row.status.runs:
        return row
    options = "; ".join(r.describe() for r in supported_rows(lmcache is not None))
    if row is not None:
        raise UnsupportedVersions(f"{row.describe()}. Supported: {options}")
    if force:
        return None
    lm = f"LMCache {lmcache}" if lmcache else "no LMCache"
    raise UnsupportedVersions(
        f"vLLM {vllm} with {lm} is not in the CacheBlend version matrix. Supported: {options}"
    )


__all__ = [
    "MATRIX",
    "MatrixRow",
    "Status",
    "UnsupportedVersions",
    "Versions",
    "check_supported",
    "detect_versions",
    "matrix_row",
    "release",
    "supported_rows",
]
