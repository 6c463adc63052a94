"""The vLLM general plugin: registered entry point, idempotent hook, unwrapping, doctor section."""

from __future__ import annotations

import importlib.metadata

import pytest

from lmcache_backend.integration.vllm import ATTENTION_PATHS, PLUGIN_ENTRY_POINT, doctor_section
from lmcache_backend.integration.vllm import plugin as plugin_mod
from lmcache_backend.integration.vllm.model_tracker import ENGINE_NAME, ModelTracker


def test_entry_point_is_registered() -> None:
    group = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert PLUGIN_ENTRY_POINT in [ep.value for ep in group]


def test_wrap_records_unwrapped_model_and_is_idempotent() -> None:
    inner = object()

    class GraphWrapper:
        def unwrap(self):
            return inner

    class Runner:
        def load_model(self):
            self.model = GraphWrapper()
            return "loaded"

    assert plugin_mod._wrap(Runner) is True
    first = Runner.load_model
    assert plugin_mod._wrap(Runner) is False, "a second wrap must change nothing"
    assert Runner.load_model is first
    ModelTracker.unregister_model(ENGINE_NAME)
    assert Runner().load_model() == "loaded"
    assert ModelTracker.get_model(ENGINE_NAME) is inner
    ModelTracker.unregister_model(ENGINE_NAME)


def test_register_wraps_the_platform_runner_once(monkeypatch) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    # a process the plugin has not run in yet (another test may have registered it here)
    original = CPUModelRunner.__dict__["load_model"]
    monkeypatch.setattr(CPUModelRunner, "load_model", getattr(original, "__wrapped__", original))
    monkeypatch.setitem(plugin_mod._state, "registered", False)
    monkeypatch.setitem(plugin_mod._state, "wrapped", [])
    plugin_mod.register()
    plugin_mod.register()
    wrapped = CPUModelRunner.__dict__["load_model"]
    assert getattr(wrapped, plugin_mod._MARK, False)
    assert not getattr(wrapped.__wrapped__, plugin_mod._MARK, False), "wrapped twice"
    assert plugin_mod.hook_status()["wrapped"] == [
        "vllm.v1.worker.cpu_model_runner.CPUModelRunner.load_model"
    ]


def test_doctor_section_reports_versions_and_hook() -> None:
    pytest.importorskip("vllm")
    title, rows = doctor_section()
    values = dict(rows)
    assert title == "vLLM integration"
    assert values["vLLM"].startswith("0.32.0")
    assert "stable" in values["matrix row"]
    assert values["plugin entry point"] == "registered"
    assert values["code path"].startswith("vLLM 0.29.0-0.33.0 (covers vLLM 0.29.0 to 0.33.0")
    assert values["gate"].startswith("runs: vLLM 0.32.0 on CPU")
    assert values["attention path"] == ATTENTION_PATHS["cpu"]
    assert values["KV-cache layout"].startswith("CPU_ATTN LBHNC: [num_blocks, num_kv_heads")


def test_wrap_passes_every_argument_through() -> None:
    """load_model's parameters differ by release (eep_scale_up, load_dummy_weights, model=)."""
    seen = {}

    class Runner:
        def load_model(self, load_dummy_weights=False, *args, model=None, **kwargs):
            seen.update(dummy=load_dummy_weights, model=model, kwargs=kwargs)
            self.model = object()

    plugin_mod._wrap(Runner)
    Runner().load_model(True, model="m", eep_scale_up=True)
    assert seen == {"dummy": True, "model": "m", "kwargs": {"eep_scale_up": True}}
    ModelTracker.unregister_model(ENGINE_NAME)


def _fake_runner_module(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> type:
    import sys
    import types

    class FakeRunner:
        def load_model(self, *args, **kwargs):
            self.model = types.SimpleNamespace(loaded_by=module)

    FakeRunner.__name__ = name
    fake = types.ModuleType(module)
    setattr(fake, name, FakeRunner)
    monkeypatch.setitem(sys.modules, module, fake)
    return FakeRunner


@pytest.mark.parametrize("platform", ["cuda", "npu", "cpu"])
def test_register_wraps_every_runner_the_release_may_build(monkeypatch, platform: str) -> None:
    """From 0.12 the V2 runner, a separate class, loads the model too (the default on CUDA from
    0.29); on NPU vllm-ascend's V1 runner, and its V2 runner through vLLM's V2 load_model."""
    from lmcache_backend import device
    from lmcache_backend.compat import gate
    from lmcache_backend.compat.vllm import profile_for

    profile = profile_for("0.33.0")
    classes = {
        r.label: _fake_runner_module(monkeypatch, r.module, r.name)
        for r in profile.runners(platform)
    }
    assert len(classes) == (1 if platform == "cpu" else 2)
    monkeypatch.setattr(gate, "code_path", lambda: profile)
    monkeypatch.setattr(device, "engine_platform", lambda: platform)
    monkeypatch.setitem(plugin_mod._state, "registered", False)
    monkeypatch.setitem(plugin_mod._state, "wrapped", [])
    plugin_mod.register()
    assert plugin_mod.hook_status()["wrapped"] == [f"{label}.load_model" for label in classes]
    for label, cls in classes.items():

        class Inheriting(cls):  # vllm-ascend's V2 NPUModelRunner defines no load_model
            pass

        ModelTracker.unregister_model(ENGINE_NAME)
        Inheriting().load_model()
        assert ModelTracker.get_model(ENGINE_NAME).loaded_by == label.rsplit(".", 1)[0]
    ModelTracker.unregister_model(ENGINE_NAME)


def test_register_skips_a_runner_this_build_lacks(monkeypatch) -> None:
    from lmcache_backend.compat.profile import Runner

    missing = Runner("vllm", "x.py", "lmcache_backend_no_such_module", "Runner")
    assert plugin_mod.install_hooks([missing]) == []


def test_doctor_what_if_shows_another_release() -> None:
    """``doctor --vllm X``: the gate's decision, code path and layout for a release that is not
    installed (here: the current CUDA release and an untested one)."""
    from lmcache_backend.integration.vllm import what_if_section

    title, rows = what_if_section("0.33.0", "cuda")
    values = dict(rows)
    assert "0.33.0" in title and values["gate"].startswith("runs: vLLM 0.33.0 on CUDA")
    assert values["code path"].startswith("vLLM 0.29.0-0.33.0")
    assert "[num_blocks, num_kv_heads, block_size" in values["KV-cache layout"]
    assert values["attention path"] == ATTENTION_PATHS["cuda"]
    _, rows = what_if_section("0.34.0", "cuda")
    values = dict(rows)
    assert values["gate"].startswith("refused: vLLM 0.34.0 is untested")
    assert "untested" in values["with allow_untested"]


def test_doctor_says_what_no_gpu_engine_has_run() -> None:
    """A CUDA release no GPU engine has run is "source contract + CPU-tensor path", not
    "stable"; on Blackwell FlashInfer's layout (LBHNC from 0.29) is named; the V2 runner is the
    default for dense models already in 0.26."""
    from lmcache_backend.integration.vllm import what_if_section

    values = dict(what_if_section("0.33.0", "cuda")[1])
    for row in ("matrix row", "gate"):
        assert "stable" not in values[row] and "source contract + CPU-tensor path" in values[row]
    assert values["KV-cache layout, SM100"].startswith(
        "FLASHINFER LBHNC: [num_blocks, num_kv_heads"
    )
    assert values["V2 runner by default for"].startswith("every model")
    values = dict(what_if_section("0.26.0", "cuda")[1])
    assert values["KV-cache layout, SM100"].startswith("FLASHINFER HND:")
    assert values["V2 runner by default for"].startswith("every dense (non-MoE)")
    # the one release an engine ran, on the platform it ran on
    values = dict(what_if_section("0.32.0", "cpu")[1])
    assert "(stable: CPU build, real engine)" in values["gate"]
    assert "KV-cache layout, SM100" not in values and "V2 runner by default for" not in values
