"""Every code path against every recorded release it claims, from the engine-contract fixtures.

The fixtures (``tests/fixtures/engine_contracts``, written by ``tools/record_engine_contracts.py``
from the published wheels) hold what each vLLM and vllm-ascend release hands a KV connector. For
each code path of :mod:`lmcache_backend.compat.vllm` and each recorded release in its range: every
symbol :meth:`VllmProfile.required_symbols` lists, ``CacheBlendConnector``'s methods against the
release's ``KVConnectorBase_V1`` and connector factory, the model runners the plugin wraps, the
KV-cache layouts and the fields derived from them. No network, no vLLM import.
"""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest
from repo_paths import FIXTURES, REPO_ROOT

from lmcache_backend.compat.ascend import ASCEND_RELEASES, NPU_KV_CACHE_LAYOUT
from lmcache_backend.compat.probe import SourceTree, missing_symbols
from lmcache_backend.compat.profile import CPU, GPU_V1, GPU_V2, NPU_V1, VllmProfile
from lmcache_backend.compat.symbols import CONNECTOR_BASE, Symbol
from lmcache_backend.compat.versions import release, vkey
from lmcache_backend.compat.vllm import (
    INCOMPATIBLE,
    PROFILES,
    VERIFIED_ON_ENGINE,
    neighbours,
    profile_for,
)

CONTRACTS = FIXTURES / "engine_contracts"
CONNECTOR_SOURCE = REPO_ROOT / "lmcache_backend/integration/vllm/connector.py"
#: Symbols the recorder does not capture; each is imported by name at start-up, so a release
#: without it fails loudly rather than quietly.
NOT_RECORDED = {"KVConnectorMetadata"}


@cache
def fixture(package: str, version: str) -> dict:
    name = "vllm" if package == "vllm" else "vllm_ascend"
    return json.loads((CONTRACTS / f"{name}-{version}.json").read_text())


@cache
def recorded(package: str) -> tuple[str, ...]:
    index = json.loads((CONTRACTS / "index.json").read_text())["fixtures"]
    return tuple(e["version"] for e in index if e["package"] == package)


def claimed() -> list[tuple[str, str]]:
    """``(code path name, release)`` for every recorded vLLM release a code path claims."""
    pairs = []
    for version in recorded("vllm"):
        profile = profile_for(version)
        if profile is not None:
            pairs.append((profile.name, version))
    return pairs


def names(params: list[str]) -> list[str]:
    """Parameter names as written in a fixture (``name=default``, ``*args``, ``**kw``, ``*``)."""
    return [p.split("=", 1)[0] for p in params if not p.startswith("*")]


def _prefix(sym: Symbol, params: list[str] | None, what: str) -> str | None:
    got = names(params or [])
    if got[: len(sym.params)] != list(sym.params):
        return f"{what}{tuple(got)} does not start with {sym.params}"
    return None


def _hook_source(entry: dict | None) -> str | None:
    return None if entry is None else entry.get("source")


def check_against_fixture(data: dict, sym: Symbol) -> str | None:
    """None when the recorded release has ``sym`` as the code path declares it, else what is
    wrong; ``"not recorded"`` when the fixture holds no fact about it."""
    hooks, api = data["hooks"], data["connector_api"]
    head, _, member = sym.qualname.partition(".")
    if sym.path == CONNECTOR_BASE:
        if sym.qualname == "KVConnectorBase_V1":
            return None if api["source"].endswith("::KVConnectorBase_V1") else "no base class"
        if sym.qualname == "KVConnectorRole":
            return None if api.get("roles_source") else "no KVConnectorRole"
        if head == "KVConnectorBase_V1":
            method = api["methods"].get(member)
            if method is None:
                return f"KVConnectorBase_V1.{member} is missing"
            return _prefix(sym, method["params"], sym.qualname)
        return "not recorded"
    if head in ("LlamaAttention", "Qwen2Attention", "Qwen3Attention") and member not in (
        "q_norm",
        "k_norm",
    ):
        entry = hooks.get(f"{head}.attributes")
        if entry is None:
            return "not recorded"
        if not entry["source"].startswith(sym.path + "::"):
            return f"{head} is not in {sym.path}"
        return f"{sym.qualname} is not set" if member in entry["missing"] else None
    if sym.path == GPU_V2.path:
        entry = data["model_runner_selection"].get("v2_runner_load_model")
        if _hook_source(entry) is None:
            return "the V2 runner has no load_model"
        return None
    key = f"_custom_ops.{sym.qualname}" if sym.path == "vllm/_custom_ops.py" else sym.qualname
    if key not in hooks:
        return "not recorded"
    source = _hook_source(hooks[key])
    if source is None:
        return f"{sym.qualname} is missing"
    if source.split("::")[0] != sym.path:
        return f"{sym.qualname} is in {source.split('::')[0]}, not {sym.path}"
    if sym.kind == "function":
        return _prefix(sym, hooks[key].get("params"), sym.qualname)
    return None


@pytest.mark.parametrize("name,version", claimed())
def test_every_symbol_of_the_code_path_is_in_the_release(name: str, version: str) -> None:
    profile = profile_for(version)
    data = fixture("vllm", version)
    problems, unknown = [], []
    for sym in profile.required_symbols():
        issue = check_against_fixture(data, sym)
        if issue == "not recorded":
            unknown.append(sym.qualname)
        elif issue:
            problems.append(issue)
    assert not problems, f"{name} on vLLM {version}:\n" + "\n".join(problems)
    assert set(unknown) <= NOT_RECORDED, f"no recorded fact for {sorted(unknown)}"


def test_every_recorded_release_is_claimed_or_known_incompatible() -> None:
    """0.9.2 to 0.33.0 all have a code path; what has none is listed with its reason."""
    unclaimed = [v for v in recorded("vllm") if profile_for(v) is None]
    assert unclaimed == sorted(INCOMPATIBLE, key=vkey)
    assert PROFILES[0].first == "0.9.2" and PROFILES[-1].last == "0.33.0"
    for earlier, later in zip(PROFILES, PROFILES[1:]):
        assert vkey(earlier.last) < vkey(later.first), "code path ranges overlap"
        assert earlier.first in recorded("vllm") and earlier.last in recorded("vllm")


def test_a_known_incompatible_release_fails_the_check() -> None:
    """The check can fail: vLLM 0.9.1 lacks the batched CachedRequestData of the 0.9.2 path."""
    for version in INCOMPATIBLE:
        _, after = neighbours(version)
        problems = [
            issue
            for sym in after.required_symbols()
            if (issue := check_against_fixture(fixture("vllm", version), sym))
            and issue != "not recorded"
        ]
        assert "CachedRequestData.req_ids is missing" in problems


def test_adjacent_code_paths_differ_in_something_recorded() -> None:
    """Each code path boundary is a real change: the earlier path's symbols, layouts or fields
    do not all hold for the later path's first release (or the reverse)."""
    for earlier, later in zip(PROFILES, PROFILES[1:]):
        fields = {
            f: getattr(earlier, f)
            for f in VllmProfile.__dataclass_fields__
            if f not in ("first", "last", "release")
        }
        assert fields != {f: getattr(later, f) for f in fields}, (earlier.name, later.name)


# -- the connector API -------------------------------------------------------------------------


@cache
def connector_methods() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(CONNECTOR_SOURCE.read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheBlendConnector"
    )
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _signature(fn: ast.FunctionDef) -> tuple[list[str], bool]:
    positional = [a.arg for a in fn.args.posonlyargs + fn.args.args][1:]  # without self
    return positional, fn.args.kwarg is not None


def _self_calls(fn: ast.FunctionDef) -> set[str]:
    return {
        n.func.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    }


@pytest.mark.parametrize("name,version", claimed())
def test_the_connector_implements_the_release_api(name: str, version: str) -> None:
    profile = profile_for(version)
    api = fixture("vllm", version)["connector_api"]
    methods = connector_methods()
    problems = []
    for method in api["abstract"]:
        if method not in methods:
            problems.append(f"abstract {method} not implemented")
    for method, fn in methods.items():
        base = api["methods"].get(method)
        if base is None or method == "__init__":
            continue  # a method the release does not call is harmless
        ours, ours_kwargs = _signature(fn)
        theirs = names(base["params"])
        extra = len(ours) - len(theirs)  # parameters vLLM does not pass need defaults
        if ours[: len(theirs)] != theirs or extra > len(fn.args.defaults):
            problems.append(f"{method}{tuple(ours)} vs the release's {tuple(theirs)}")
        if "**kwargs" in base["params"] and not ours_kwargs:
            problems.append(f"{method} must accept **kwargs like the release's")
    own = set(methods)
    for called in set().union(*(_self_calls(fn) for fn in methods.values())):
        if called not in own and called not in api["methods"]:
            problems.append(f"the connector calls self.{called}, which the release lacks")
    for called in profile.connector_base_calls:
        if called not in api["methods"]:
            problems.append(f"the code path calls {called}, which the release lacks")
    assert not problems, f"{name} on vLLM {version}:\n" + "\n".join(problems)


@pytest.mark.parametrize("name,version", claimed())
def test_the_connector_constructor_fits_the_release_factory(name: str, version: str) -> None:
    profile = profile_for(version)
    api = fixture("vllm", version)["connector_api"]
    assert list(profile.connector_init_params) == names(api["methods"]["__init__"]["params"])
    check = api["factory"].get("kv_cache_config_check")
    refuses = check is not None and check["action"] == "raise"
    assert profile.connector_requires_kv_cache_config == refuses
    params, _ = _signature(connector_methods()["__init__"])
    assert params[:2] == ["vllm_config", "role"]
    if check is not None:  # supports_kw(connector_cls, "kv_cache_config")
        assert "kv_cache_config" in params
    for call in api["factory"]["instantiation"]:  # connector_cls(config, role[, kv_cache_config])
        passed = call[call.index("(") + 1 : -1].split(", ")
        defaults = len(connector_methods()["__init__"].args.defaults)
        assert len(params) - defaults <= len(passed) <= len(params), call


def test_step_metadata_only_calls_what_the_code_path_declares() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def has_connector_metadata(self) -> bool:
            self.calls.append("has_connector_metadata")
            return True

        def _get_connector_metadata(self) -> object:
            self.calls.append("_get_connector_metadata")
            return object()

    for profile in PROFILES:
        connector = Recorder()
        profile.step_metadata(connector)
        assert set(connector.calls) <= set(profile.connector_base_calls), profile.name


# -- fields derived from the records -------------------------------------------------------------


@pytest.mark.parametrize("name,version", claimed())
def test_profile_fields_match_the_release(name: str, version: str) -> None:
    profile = profile_for(version)
    data = fixture("vllm", version)
    methods = data["connector_api"]["methods"]
    timing = data["kv_transfer_init"]["kv_transfer_after_model_load"]
    assert profile.kv_transfer_after_model_load == bool(timing)
    assert profile.sliced_loads == ("update_connector_output" in methods)
    assert ("has_connector_metadata" in profile.connector_base_calls) == (
        "has_connector_metadata" in methods
    )
    other = {"embed_input_ids": "get_input_embeddings"}.get(profile.embed_method, "embed_input_ids")
    assert _hook_source(data["hooks"].get(f"LlamaModel.{other}")) is None


@pytest.mark.parametrize("name,version", claimed())
def test_the_plugin_wraps_every_runner_the_release_builds(name: str, version: str) -> None:
    profile = profile_for(version)
    data = fixture("vllm", version)
    has_v2 = data["model_runner_selection"].get("v2_runner") is not None
    assert profile.runners("cuda") == ((GPU_V1, GPU_V2) if has_v2 else (GPU_V1,))
    assert profile.runners("cpu") == (CPU,)
    assert profile.runners("npu") == ((NPU_V1, GPU_V2) if has_v2 else (NPU_V1,))
    for runner in (GPU_V1, CPU):
        entry = data["hooks"][f"{runner.name}.load_model"]
        assert entry["source"] == f"{runner.path}::{runner.name}.load_model"


def _default_layout(data: dict, backend: str) -> tuple[str, dict]:
    tensor = (data["attention_backends"].get(backend) or {}).get("registered_tensor") or {}
    if "default_layout" in tensor:
        order = tensor["default_layout"][0]["layout"]
    else:
        order = data["kv_cache_layout"]["default"]
    return order, tensor.get(order, {})


@pytest.mark.parametrize("name,version", claimed())
def test_kv_cache_layouts_match_the_release(name: str, version: str) -> None:
    profile = profile_for(version)
    data = fixture("vllm", version)
    for platform, backend in (("cuda", "FLASH_ATTN"), ("cpu", "CPU_ATTN")):
        order, tensor = _default_layout(data, backend)
        layout = profile.kv_cache_layouts.get(platform)
        if not tensor:
            assert layout is None, f"{backend} records no tensor in {version}"
            continue
        assert layout is not None and layout.backend == backend and layout.order == order
        assert list(layout.shape) == tensor["logical_shape"]
        physical = tensor["physical_shape"]
        assert list(layout.memory or layout.shape) == physical


@pytest.mark.parametrize("name,version", claimed())
def test_the_cpu_code_path_exists_exactly_where_the_cpu_layout_is_read(
    name: str, version: str
) -> None:
    """The CPU layout reads the heads from dim 1 and the block size from dim 2 of the registered
    cache and passes k_scale, v_scale and kv_cache_dtype to the cache-write op."""
    profile = profile_for(version)
    data = fixture("vllm", version)
    _, tensor = _default_layout(data, "CPU_ATTN")
    shape_fits = tensor.get("logical_shape", [None] * 3)[1:3] == ["num_kv_heads", "block_size"]
    op = data["hooks"].get("_custom_ops.cpu_attn_reshape_and_cache")
    op_fits = op is not None and {"k_scale", "v_scale", "kv_cache_dtype"} <= set(
        names(op["params"])
    )
    assert profile.has_cpu_path == (shape_fits and op_fits)


def _sm100_order(data: dict) -> str | None:
    """The layout vLLM has FLASHINFER read on SM100 (device capability major 10): required
    (0.11.2-0.28), the default of its supported layouts (0.29+), or forced by the CUDA
    platform's ``set_kv_cache_layout('HND')`` (0.10.x-0.11.0, on capability 100)."""
    entry = data["attention_backends"]["FLASHINFER"] or {}
    for r in (entry.get("required_kv_cache_layout") or {}).get("returns", []):
        if "major == 10" in (r["when"] or ""):
            return r["value"].strip("'")
    for r in (entry.get("registered_tensor") or {}).get("default_layout", []):
        if "major == 10" in (r["when"] or ""):
            return r["layout"]
    for f in data["kv_cache_layout"].get("forced_by", []):
        if f["source"].startswith("vllm/platforms/cuda.py::") and "'HND'" in f["call"]:
            return "HND"
    return None


@pytest.mark.parametrize("name,version", claimed())
def test_the_sm100_layout_is_flashinfers_there(name: str, version: str) -> None:
    """``doctor``'s "KV-cache layout, SM100" row: FLASHINFER's registered tensor in the layout
    vLLM resolves on Blackwell (HND up to 0.28, LBHNC from 0.29)."""
    profile = profile_for(version)
    data = fixture("vllm", version)
    order = _sm100_order(data)
    layout = profile.kv_cache_layouts.get("cuda-sm100")
    if layout is None:
        # 0.9.2 leaves FlashInfer's layout alone on SM100 and 0.10.0 forces HND: one code path
        # without one answer, so none is claimed
        assert profile.first == "0.9.2" and order in (None, "HND"), (version, order)
        return
    assert order is not None, f"{version} records no SM100 layout"
    tensor = data["attention_backends"]["FLASHINFER"]["registered_tensor"][order]
    assert (layout.backend, layout.order) == ("FLASHINFER", order)
    assert list(layout.shape) == tensor["logical_shape"]
    assert list(layout.memory or layout.shape) == tensor["physical_shape"]


def _v2_default_facts(data: dict) -> tuple[str, list[str]]:
    """``(kind, architectures)`` of a release's default V2-runner choice: ``none`` (no default
    path), ``all``, ``listed`` (the listed architectures only), ``listed-dense`` (listed, unless
    MoE or quantized) or ``dense`` (every non-MoE model and the listed ones)."""
    selection = data["model_runner_selection"]
    use = selection.get("use_v2_model_runner")
    if use is None:
        return "none", []
    archs = selection.get("default_v2_architectures") or []
    default = selection.get("is_default_v2_model_runner_model")
    if default is None:
        assert use["returns"][-1] == {"value": True, "when": None}
        return "all", []
    last = default["returns"][-1]["value"]
    if "or not model_config.is_moe" in last:
        return "dense", archs
    if "not model_config.is_moe and (not model_config.is_quantized)" == last:
        return "listed-dense", archs
    assert last.startswith("any((arch in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"), last
    return "listed", archs


@pytest.mark.parametrize("version", [v for v in recorded("vllm") if vkey(v) >= vkey("0.12.0")])
def test_the_v2_runner_default_is_the_releases(version: str) -> None:
    """``V2_RUNNER_DEFAULT`` (the compat table's text and ``doctor``) against the release's
    ``use_v2_model_runner``: dense models from 0.25.1, not only from 0.29."""
    from lmcache_backend.compat.vllm import v2_runner_default

    kind, archs = _v2_default_facts(fixture("vllm", version))
    text = v2_runner_default(version)
    assert text is not None, f"V2_RUNNER_DEFAULT has no row for {version}"
    expected = {
        "none": "none (only with VLLM_USE_V2_MODEL_RUNNER=1)",
        "all": "every model",
        "dense": "every dense (non-MoE) generative model",
        "listed-dense": "unless MoE or quantized",
        "listed": "the listed architectures only",
    }[kind]
    assert expected in text, (version, kind, text)
    if kind in ("listed", "listed-dense"):
        assert all(a in text for a in archs), (version, archs, text)


def _hardware_engine_runs(text: str) -> set[tuple[str, str]]:
    """``(vLLM release, platform)`` of every section of docs/hardware.md whose version line names
    a vLLM release and whose table has a passing ``verify`` row (a real engine's run)."""
    runs = set()
    for section in text.split("\n### ")[1:]:
        heading, _, body = section.partition("\n")
        version = re.search(r"\bvLLM (\d+\.\d+\.\d+)", body.split("\n|", 1)[0])
        verified = re.search(r"^\| verify \|[^|]*\| pass \|", body, re.MULTILINE)
        if version and verified:
            platform = "npu" if re.search(r"Ascend|NPU", heading) else "cuda"
            runs.add((version.group(1), platform))
    return runs


def test_a_gpu_or_npu_release_is_stable_only_where_hardware_md_records_its_run() -> None:
    """``stable`` on CUDA or Ascend needs a vLLM engine run recorded in docs/hardware.md (none
    yet: the one GPU run had no vLLM), else doctor says "source contract + CPU-tensor path"."""
    runs = _hardware_engine_runs((REPO_ROOT / "docs" / "hardware.md").read_text())
    for version, platforms in VERIFIED_ON_ENGINE.items():
        for platform in set(platforms) & {"cuda", "npu"}:
            assert (version, platform) in runs, f"{version} on {platform}: no run in hardware.md"


# -- vllm-ascend ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", recorded("vllm-ascend"))
def test_vllm_ascend_release_matches_its_record(version: str) -> None:
    data = fixture("vllm-ascend", version)
    asc = next(a for a in ASCEND_RELEASES if a.version == version)
    assert asc.vllm == data["pins"]["pinned_vllm"]
    assert asc.kv_transfer_after_model_load == data["worker"]["kv_transfer_after_model_load"]
    runner = data["model_runner"]
    assert runner["class"] == f"{NPU_V1.path}::{NPU_V1.name}"
    assert runner["load_model"]["source"] == f"{NPU_V1.path}::{NPU_V1.name}.load_model"
    v2 = runner.get("v2_runner")
    assert asc.v2_runner == (v2 is not None)
    profile = profile_for(asc.vllm)
    if not asc.supported:
        assert profile is None and release(asc.vllm) in INCOMPATIBLE
        return
    assert profile is not None, f"vllm-ascend {version} pins vLLM {asc.vllm}, which has no path"
    if v2 is not None:  # inherits vLLM's V2 load_model, which the plugin wraps on NPU
        assert v2["load_model"] is None and v2["bases"] == ["GPUModelRunner"]
        assert GPU_V2 in profile.runners("npu")
    shape = ", ".join(NPU_KV_CACHE_LAYOUT.shape)
    assert any(f"[{shape}]" in a["fact"] for a in data["annotations"])


# -- the installed release ---------------------------------------------------------------------


def test_installed_release_source_has_every_symbol() -> None:
    """The same code path against the installed vLLM's own files (0.32.0 on CPU here), through
    the probe the gate uses for releases without a record."""
    vllm = pytest.importorskip("vllm")
    profile = profile_for(vllm.__version__)
    assert profile is not None, f"no code path for installed vLLM {vllm.__version__}"
    source = SourceTree(Path(vllm.__file__).resolve().parent.parent)
    assert missing_symbols(profile, source) == []
    older = PROFILES[0]  # its rotary file and constructor are gone: the probe must say so
    assert missing_symbols(older, source)
