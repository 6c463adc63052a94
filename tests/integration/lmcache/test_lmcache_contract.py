"""The LMCache glue against the real LMCache release wheels, read as source (no import).

Each release in the version matrix is downloaded once into ``<repo>/.cache/lmcache-wheels/``
(CUDA builds for Python 3.12: they cannot be installed here, only read). Every symbol a glue
family declares must exist with the declared signature in its own release, and each family's
declarations must fail on the other releases, so picking the glue by version matters.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from lmcache_backend.blend.interfaces import BlendOutput, BlendRetrieverResult
from lmcache_backend.compat import MATRIX, Status
from lmcache_backend.compat.lmcache import FAMILIES, LEGACY_FIELDS, LEGACY_INTERFACES, family_for
from lmcache_backend.integration.lmcache import contract, hooks
from lmcache_backend.integration.lmcache.glue import GLUES, LMCacheBlender

CACHE = REPO_ROOT / ".cache" / "lmcache-wheels"
RELEASES = sorted(
    {row.lmcache for row in MATRIX if row.lmcache and row.status is Status.STABLE},
    key=lambda v: tuple(int(p) for p in v.split(".")),
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux2014_x86_64")


def _download(version: str) -> Path | None:
    folder = CACHE / version
    found = sorted(folder.glob(f"lmcache-{version}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    for platform in PLATFORMS:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--platform",
            platform,
            f"lmcache=={version}",
            "-d",
            str(folder),
            "--quiet",
        ]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        except (subprocess.SubprocessError, OSError):
            continue
        found = sorted(folder.glob(f"lmcache-{version}-*.whl"))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    """release -> folder holding its unpacked ``lmcache`` Python sources."""
    out = {}
    for version in RELEASES:
        wheel = _download(version)
        if wheel is None:
            continue
        root = tmp_path_factory.mktemp(f"lmcache-{version}")
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("lmcache/") and name.endswith(".py"):
                    zf.extract(name, root)
        out[version] = root
    return out


def _root(sources: dict[str, Path], version: str) -> Path:
    if version not in sources:
        pytest.skip(f"LMCache {version} wheel could not be downloaded from PyPI (offline?)")
    return sources[version]


def test_every_stable_release_has_a_glue():
    assert RELEASES == ["0.3.3", "0.3.7", "0.3.12"]
    for version in RELEASES:
        family = family_for(version)
        assert family is not None and version in family.verified
        assert family.name in GLUES


@pytest.mark.parametrize("version", RELEASES)
def test_glue_symbols_match_their_release(sources, version):
    family = family_for(version)
    assert contract.check(_root(sources, version), family) == []


@pytest.mark.parametrize(
    "family,version",
    [(f, v) for f in FAMILIES for v in RELEASES if v not in f.verified],
    ids=lambda x: getattr(x, "name", x),
)
def test_glue_of_another_release_does_not_fit(sources, family, version):
    problems = contract.check(_root(sources, version), family)
    assert problems, f"the {family.name} glue would pass on LMCache {version}"


@pytest.mark.parametrize("version", RELEASES)
def test_replaced_bindings_exist_in_their_release(sources, version):
    family = family_for(version)
    root = _root(sources, version)
    keys = {sym.key for sym in family.replaced}
    assert {"builder_get_or_create", "rope_hook", "attn_hook"} <= keys
    assert ("legacy_executor" in keys) == (version != "0.3.12")
    for sym in family.replaced:
        assert contract.check_symbol(root, sym) is None


def _params(fn) -> tuple[str, ...]:
    sig = inspect.signature(fn)
    return tuple(
        name
        for name, p in sig.parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name not in ("self", "cls")
    )


def _declared(family, key) -> tuple[str, ...]:
    return family.symbol(key).params


@pytest.mark.parametrize("version", RELEASES)
def test_replacements_take_what_lmcache_passes(sources, version):
    """Each replacement is called like the LMCache object it replaces (names and order)."""
    family = family_for(version)
    _root(sources, version)  # the declarations were checked against this release above
    glue = GLUES[family.name]()
    repl = glue.replacements("torch")
    assert _params(repl["builder_get_or_create"].__func__) == _declared(
        family, "builder_get_or_create"
    )
    assert _params(repl["rope_hook"]) == _declared(family, "rope_factory")
    attn = repl["attn_hook"]
    if inspect.isclass(attn):
        assert _params(attn.__init__) == _declared(family, "attn_backend_init")
    else:
        assert _params(attn) == _declared(family, "attn_factory")
        assert _params(hooks.ExactMaskAttention.init_attn_metadata) == _declared(
            family, "attn_init_metadata"
        )
    assert _params(hooks.ExactMaskAttention.forward_contiguous) == _declared(family, "attn_forward")
    assert _params(hooks.KeyRerotation.__call__) == _declared(family, "rope_call")
    assert _params(LMCacheBlender.process_qkv) == _declared(family, "blender_process_qkv")
    assert _params(LMCacheBlender.blend) == _declared(family, "blender_blend")
    assert _params(LMCacheBlender.blend_layer) == _declared(family, "blender_blend_layer")
    if family.has_legacy_blend:
        assert _params(repl["legacy_executor"].__init__) == _declared(
            family, "legacy_executor_init"
        )
        assert _params(repl["legacy_executor"].blend) == _declared(family, "legacy_executor_blend")


@pytest.mark.parametrize("version", [v for v in RELEASES if family_for(v).has_legacy_blend])
def test_legacy_dataclasses_have_lmcache_fields(sources, version):
    root = _root(sources, version)
    for cls, ours in (("BlendOutput", BlendOutput), ("BlendRetrieverResult", BlendRetrieverResult)):
        theirs = contract.dataclass_fields(root, LEGACY_INTERFACES, cls)
        assert theirs == LEGACY_FIELDS[cls]
        assert tuple(ours.__dataclass_fields__) == theirs


def test_checker_reports_a_changed_signature(sources):
    """The checker is not vacuous: a declaration with one wrong argument is reported."""
    from dataclasses import replace

    root = _root(sources, "0.3.12")
    sym = family_for("0.3.12").symbol("gpu_get_kv")
    assert contract.check_symbol(root, sym) is None
    assert "takes" in contract.check_symbol(root, replace(sym, params=("layer",)))
    missing = replace(sym, qualname="VLLMBufferLayerwiseGPUConnector.get_kv_cache")
    assert "not defined" in contract.check_symbol(root, missing)
