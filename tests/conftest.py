"""Shared fixtures of the test suite (helpers to import live in modules beside this file:
``numerics``, ``repo_paths``, ``tiny_hf``, ``redis_server``, ``vllm_scripts``, ...).

:data:`DEVICE` is where the tests put their tensors and tiny models: the GPU when one is visible,
so the Triton kernels are compiled and run there; otherwise the CPU, where the same kernels run
through Triton's interpreter. The interpreter's variable must be set before ``triton`` is first
imported, so it is set here, at collection start (and only without a GPU, so a GPU run tests the
compiled kernels).
"""

from __future__ import annotations

import os

import torch
from numerics import DEVICE  # noqa: E402

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """:data:`DEVICE` as a ``torch.device``, for tests that take it as a fixture."""
    return torch.device(DEVICE)


@pytest.fixture
def seeded() -> torch.Generator:
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)
