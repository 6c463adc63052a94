"""Where the tests find the repository, its benchmark scripts and their recorded fixtures,
whatever folder they are in."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: the tests' root folder (this file's)
TESTS = Path(__file__).resolve().parent
#: the repository's root
REPO_ROOT = TESTS.parent
#: recorded data the tests read (e.g. ``engine_contracts/``)
FIXTURES = TESTS / "fixtures"


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` imported as a module (the folder is not a package), registered in
    ``sys.modules`` so that its dataclasses and pickling find it."""
    path = REPO_ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
