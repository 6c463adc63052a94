"""Version strings by PEP 440's rules (``packaging``): what counts as the same release, what
sorts before what, and that a string that is not a version is an error, never ``0.0.0``."""

from __future__ import annotations

import pytest
from packaging.version import InvalidVersion

from lmcache_backend.compat.gate import decide
from lmcache_backend.compat.versions import Versions, nearest, parse_version, release, vkey


@pytest.mark.parametrize(
    "version, core",
    [
        ("0.11.0+cpu", "0.11.0"),
        ("0.10.0.post1", "0.10.0"),
        ("0.3.12rc1", "0.3.12"),
        ("0.23.0.post1", "0.23.0"),
        ("1.2", "1.2.0"),
        ("v0.33.0", "0.33.0"),
        ("0.11.1.dev123+g1234abc.cu128", "0.11.1"),
    ],
)
def test_the_release_core(version, core) -> None:
    assert release(version) == core


def test_releases_sort_by_number_not_text() -> None:
    assert vkey("0.10.2") > vkey("0.9.2") and vkey("0.33.0") > vkey("0.4.0")
    assert nearest("0.30.0", ["0.29.0", "0.33.0"]) == "0.29.0"
    assert release(None) is None and release("") is None


@pytest.mark.parametrize("bad", ["banana", "0.x.1", "latest", "1..2", "0.33.0-final-final"])
def test_a_string_that_is_not_a_version_is_an_error(bad) -> None:
    with pytest.raises(InvalidVersion, match="is not a version"):
        parse_version(bad)
    with pytest.raises(InvalidVersion):
        release(bad)


def test_the_gate_refuses_to_guess_a_version() -> None:
    with pytest.raises(InvalidVersion):
        decide(Versions(vllm="banana", vllm_ascend=None, lmcache=None, torch=None), "cuda", False)
