"""The settings objects' typed fields: generated from the registry (drift fails like the docs'
tables), truthful about the values, seen by the type checker (a misspelt field is an error), and
each value parsed once and checked against the model once per start."""

from __future__ import annotations

import importlib.util
import os
import typing
from collections import Counter
from dataclasses import fields

import pytest
from repo_paths import REPO_ROOT

from lmcache_backend.config import BlendConfig, load_config
from lmcache_backend.settings import ENGINE, REGISTRY, Scope, Setting
from lmcache_backend.settings import parsers as p
from lmcache_backend.settings.codegen import SOURCE_FILES, block, key_of
from lmcache_backend.settings.docs import stale


def test_every_generated_block_is_the_registrys() -> None:
    """``lmcache-backend config --docs`` regenerates them; run it after changing a setting."""
    drift = {name for name in stale(REPO_ROOT) if name.endswith(".py")}
    assert not drift, f"run `lmcache-backend config --docs`: {sorted(drift)} differ"


def test_a_new_setting_makes_the_typed_fields_stale(monkeypatch) -> None:
    new = Setting("blend_new_knob", Scope.ENGINE, p.integer(minimum=0), 3, "a knob")
    monkeypatch.setitem(ENGINE, new.name, new)
    drift = stale(REPO_ROOT)
    assert {"lmcache_backend/config.py", "lmcache_backend/settings/writer.py"} <= set(drift)
    text, regenerated = drift["lmcache_backend/config.py"]
    assert 'blend_new_knob: int = setting_field(ENGINE["blend_new_knob"])' in regenerated
    assert "blend_new_knob" not in text
    assert "    blend_new_knob: int\n" in drift["lmcache_backend/settings/writer.py"][1]


def test_a_changed_type_makes_the_typed_fields_stale(monkeypatch) -> None:
    old = ENGINE["blend_min_tokens"]
    monkeypatch.setitem(ENGINE, old.name, Setting(old.name, old.scope, p.number(), 1.0, "x"))
    assert "lmcache_backend/config.py" in stale(REPO_ROOT)


def test_the_generated_fields_are_the_objects_fields() -> None:
    from lmcache_backend.integration.vllm.settings import ConnectorSettings
    from lmcache_backend.storage.settings import StoreSettings

    hints = typing.get_type_hints(BlendConfig)
    assert [f.name for f in fields(BlendConfig) if f.name != "sources"] == list(ENGINE)
    for name, setting in ENGINE.items():
        assert BlendConfig.__annotations__[name] == setting.parse.annotation
        assert hints[name] is not typing.Any, name
    for cls in (ConnectorSettings, StoreSettings):
        for f in fields(cls):
            if "setting" in f.metadata:
                assert f.type == f.metadata["setting"].parse.annotation, (cls, f.name)
    assert "    # <settings-fields: dataclass engine>" in (REPO_ROOT / SOURCE_FILES[0]).read_text()
    with pytest.raises(ValueError, match="no dataclass of scope 'environment'"):
        block("dataclass environment")


def _conforms(value: object, annotation: str) -> bool:
    """Whether ``value`` is of the type ``annotation`` writes (the forms parsers declare)."""
    kinds = {"bool": bool, "int": int, "float": float, "str": str}
    alternatives = [a.strip() for a in annotation.split("|")]
    if len(alternatives) > 1:
        return any(_conforms(value, a) for a in alternatives)
    if value is None:
        return annotation == "None"
    if annotation.startswith("list["):
        item = annotation[5:-1]
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if annotation.startswith("dict["):
        return isinstance(value, dict)
    kind = kinds[annotation]
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


SAMPLES = ["0", "1", "0.5", "true", "auto", "[1, 2]", "0.3,0.15", "{}", "text", "", None, 2, 0.25]


@pytest.mark.parametrize("setting", REGISTRY, ids=lambda s: f"{s.scope.value}:{s.name}")
def test_every_parser_returns_the_type_it_declares(setting) -> None:
    """A field's declared type is what its parser returns, for its default and any value it
    takes."""
    assert setting.parse.annotation != "Any", setting.name
    assert _conforms(setting.default_value(), setting.parse.annotation), setting.name
    for raw in SAMPLES:
        try:
            value = setting.parse(raw)
        except (TypeError, ValueError):
            continue
        assert _conforms(value, setting.parse.annotation), (setting.name, raw, value)
    if setting.scope in (Scope.ENGINE, Scope.ENVIRONMENT):  # the writer's keyword arguments
        assert key_of(setting).isidentifier()


# -- the type checker -------------------------------------------------------------------------


def _typecheck():
    spec = importlib.util.spec_from_file_location("typecheck", REPO_ROOT / "tools" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_misspelt_setting_is_a_type_error(tmp_path) -> None:
    """mypy (``make typecheck``) sees the settings objects' fields and the writer's names."""
    source = tmp_path / "user.py"
    source.write_text(
        "from lmcache_backend.config import load_config\n"
        "from lmcache_backend.settings.writer import child_env\n"
        "config = load_config()\n"
        "ratios: list[float] = config.blend_recompute_ratios\n"
        "wrong = config.blend_recompute_ratio\n"
        "layers: str = config.blend_check_layers\n"
        "child_env(blend_recompute_ratio=[0.2])\n"
        "child_env(vllm_cpu_kvcache_space='2')\n"
    )
    errors = _typecheck().run_mypy(str(source))
    lines = sorted(int(line.split(":")[1]) for line in errors)
    assert lines == [5, 6, 7, 8], errors
    assert '"BlendConfig" has no attribute "blend_recompute_ratio"' in errors[0]


def test_the_baseline_only_shrinks(tmp_path) -> None:
    typecheck = _typecheck()
    known = "a.py:3: error: Name 'x' is not defined  [name-defined]"
    moved = "a.py:9: error: Name 'x' is not defined  [name-defined]"
    other = "b.py:1: error: Incompatible types in assignment  [assignment]"
    baseline = Counter([typecheck.entry(known)])
    assert typecheck.compare([moved], baseline) == ([], Counter())  # a moved line is known
    assert typecheck.compare([moved, other], baseline) == ([other], Counter())
    assert typecheck.compare([], baseline) == ([], baseline)  # fixed: shrink the baseline
    assert typecheck.entry("c.py:4: error: defined on line 12  [no-redef]") == (
        "c.py: defined on line N  [no-redef]"
    )
    path = tmp_path / "baseline.txt"
    typecheck.write_baseline(Counter([typecheck.entry(known)] * 2), path)
    assert typecheck.read_baseline(path) == Counter({typecheck.entry(known): 2})


def test_the_committed_baseline_is_sorted_and_names_package_files() -> None:
    typecheck = _typecheck()
    lines = [
        line
        for line in typecheck.BASELINE.read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines == sorted(lines)
    assert all(line.startswith("lmcache_backend/") for line in lines)


# -- one parse and one model check per start ---------------------------------------------------


def test_a_loaded_value_is_parsed_once(monkeypatch) -> None:
    calls: Counter[str] = Counter()
    real = Setting.value

    def counting(self, raw, where):
        calls[self.name] += 1
        return real(self, raw, where)

    monkeypatch.setattr(Setting, "value", counting)
    env = {"LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.3", "LMCACHE_BLEND_MIN_TOKENS": "64"}
    config = load_config(env=env, blend_selection="kv_deviation")
    assert config.blend_recompute_ratios == [0.3] and config.blend_selection == "kv_deviation"
    assert calls == Counter(blend_recompute_ratios=1, blend_min_tokens=1, blend_selection=1)
    calls.clear()
    config.replace(blend_check_layers=[1, 2])
    assert calls == Counter(blend_check_layers=1)
    calls.clear()  # a request's kv_transfer_params: parsed once, by the request's reader
    from lmcache_backend.integration.vllm.settings import request_config

    params = {"blend_recompute_ratios": "0.5", "blend_selection": "kv_deviation"}
    out = request_config(config.replace(enable_blending=True), params, num_layers=4)
    assert out is not None and out.blend_recompute_ratios == [0.5]
    assert calls == Counter(enable_blending=1, blend_recompute_ratios=1, blend_selection=1)


@pytest.mark.slow
def test_a_start_checks_the_configuration_against_the_model_once(monkeypatch, tmp_path) -> None:
    """The connector's settings check the check layers against the model; the blender built on
    the same configuration does not check again."""
    from fake_vllm_config import vllm_config
    from tiny_hf import SEP, tiny_model

    from lmcache_backend.blend import LMCBlender
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.integration.vllm.settings import load_settings
    from lmcache_backend.models.hf import HFModelAdapter
    from lmcache_backend.ops import get_ops
    from lmcache_backend.storage import MemoryTier

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    checks: list[int] = []
    real = BlendConfig._check_layers

    def counting(self, num_layers):
        checks.append(num_layers)
        return real(self, num_layers)

    monkeypatch.setattr(BlendConfig, "_check_layers", counting)
    extra = {"enable_blending": True, "blend_check_layers": [1, 3], "blend_recompute_ratios": 0.3}
    settings = load_settings(vllm_config(str(embedded_model_path()), extra, num_layers=4))
    adapter = HFModelAdapter(tiny_model("llama"))
    store = MemoryTier(adapter.device, 1 << 20, adapter.device.type)
    LMCBlender(store, None, settings.config, adapter, SEP, get_ops("torch"))
    assert checks == [4]
    with pytest.raises(ValueError, match="layer 3 does not exist"):
        settings.config.validate_for_model(3)  # another model is checked
