"""Echoed values are cut: a client's huge value never makes a huge log line."""

from __future__ import annotations

import pytest

from lmcache_backend.logtext import MAX_SHOWN, shorten, shown


@pytest.mark.parametrize(
    "value",
    [
        [0.5] * 1_000_000,
        {"blend_recompute_ratios": [0.5] * 1_000_000},
        "9" * 1_000_000,
        ["y" * 1_000_000],
        {f"blend_{i}": 1 for i in range(100_000)},
        [[[[["deep"] * 1000] * 1000]]],
        10**4000,
    ],
    ids=["list", "nested list", "string", "long item", "many keys", "deep", "huge int"],
)
def test_a_huge_value_is_shown_cut(value) -> None:
    text = shown(value)
    assert len(text) <= MAX_SHOWN + 60, len(text)
    assert text[:3] == repr(value)[:3]  # its start, as repr writes it


def test_a_small_value_is_shown_whole_and_a_large_container_counted() -> None:
    assert shown([1, 2]) == "[1, 2]" and shown("a'b") == repr("a'b")
    assert shown(list(range(1000))).endswith("(list of 1000 items)")
    assert shorten("x" * 10) == "x" * 10
    assert shorten("x" * 1000) == "x" * MAX_SHOWN + "... (1000 characters)"
    assert shown(10**5000) == "<int that cannot be shown>"  # past Python's digit limit
