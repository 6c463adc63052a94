"""The releases recorded by default, the fixture schema, and the order of versions."""

from __future__ import annotations

import re

SCHEMA = 1

#: Releases recorded by default. vLLM: 0.9.2, the last patch of each minor from 0.10 on, plus
#: 0.10.0 and 0.11.0, where the LMCache matrix has rows, and 0.9.1, which vllm-ascend 0.9.1 pins.
RELEASES: dict[str, list[str]] = {
    "vllm": [
        "0.9.1", "0.9.2", "0.10.0", "0.10.2", "0.11.0", "0.11.2", "0.12.0", "0.13.0", "0.14.1",
        "0.15.1", "0.16.0", "0.17.1", "0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0",
        "0.24.0", "0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
        "0.33.0",
    ],
    "vllm-ascend": ["0.9.1", "0.11.0", "0.13.0", "0.18.0", "0.23.0.post1"],
}  # fmt: skip


def vkey(version: str) -> tuple:
    """Sort key of ``X.Y.Z`` with an optional ``.postN`` / ``rcN``."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?", version)
    if not m:
        raise ValueError(f"unparsable version {version!r}")
    major, minor, patch, extra, post = m.groups()
    return (int(major), int(minor), int(patch), int(extra or 0), int(post or 0))


def in_range(version: str, lo: str, hi: str) -> bool:
    return vkey(lo) <= vkey(version) <= vkey(hi)


def dist_name(package: str) -> str:
    return package.replace("-", "_")
