"""The vLLM general plugin: registered entry point, idempotent hook, unwrapping, doctor section."""

from __future__ import annotations

import importlib.metadata

import pytest

from lmcache_backend.integration.vllm import PLUGIN_ENTRY_POINT, doctor_section
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


def test_register_wraps_the_platform_runner_once() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

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
