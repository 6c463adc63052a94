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

#: set to 1 to run the tests marked ``real_model`` (they need an embedded model's package and
#: run engines on it for minutes)
REAL_MODELS_VARIABLE = "LMCACHE_TEST_REAL_MODELS"


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get(REAL_MODELS_VARIABLE) == "1":
        return
    skip = pytest.mark.skip(reason=f"opt-in: set {REAL_MODELS_VARIABLE}=1 to run")
    for item in items:
        if "real_model" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A real 3-primary Redis Cluster shared by a module's tests (``redis_deployments.py``)."""
    from redis_deployments import RedisClusterNodes

    nodes = RedisClusterNodes(tmp_path_factory.mktemp("cluster"))
    nodes.start()
    yield nodes
    nodes.stop()


@pytest.fixture
def device() -> torch.device:
    """:data:`DEVICE` as a ``torch.device``, for tests that take it as a fixture."""
    return torch.device(DEVICE)


@pytest.fixture
def seeded() -> torch.Generator:
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)
