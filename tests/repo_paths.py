"""Where the tests find the repository and their recorded fixtures, whatever folder they are in."""

from __future__ import annotations

from pathlib import Path

#: the tests' root folder (this file's)
TESTS = Path(__file__).resolve().parent
#: the repository's root
REPO_ROOT = TESTS.parent
#: recorded data the tests read (e.g. ``engine_contracts/``)
FIXTURES = TESTS / "fixtures"
