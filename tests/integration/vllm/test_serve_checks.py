"""What ``lmcache-backend serve`` checks before vLLM starts: the KV-cache memory of vLLM's CPU
build (chosen when unset, refused when it cannot fit), the connector's configuration from a
``--kv-transfer-config`` of the user's, and the model's layers. Starting the server with the
chosen size for real: the demo and tests/integration/vllm/test_vllm_server.py."""

from __future__ import annotations

import json

import pytest

from lmcache_backend.config import ConfigError
from lmcache_backend.errors import UsageError
from lmcache_backend.integration.vllm.serving import checks as serve_checks
from lmcache_backend.integration.vllm.serving.checks import (
    GIB,
    KV_SPACE_ENV,
    Memory,
    cpu_kv_cache,
    preflight,
)

#: a 24 GiB machine with 20 GiB free, a 0.27 GB model, the store's default 5 GB
MACHINE = Memory(total=24 * GIB, available=20 * GIB)
WEIGHTS = 269_060_552
STORE = 5e9


def test_an_unset_kv_cache_gets_half_of_what_is_free_and_says_so() -> None:
    settings, message = cpu_kv_cache([], {}, MACHINE, WEIGHTS, STORE)
    spare = 20 * GIB - WEIGHTS - STORE - serve_checks.PROCESS_RESERVE_BYTES
    assert settings == {"vllm_cpu_kvcache_space": int(spare / 2 // GIB)}
    assert settings == {"vllm_cpu_kvcache_space": 6}
    assert message and "using 6 GiB" in message and f"set {KV_SPACE_ENV}" in message
    # a busier machine gets less, never less than 1 GiB
    small = Memory(total=24 * GIB, available=int(5.5 * GIB))
    assert cpu_kv_cache([], {}, small, WEIGHTS, 0.0)[0] == {"vllm_cpu_kvcache_space": 1}


def test_no_room_for_a_kv_cache_is_refused_naming_the_numbers() -> None:
    busy = Memory(total=24 * GIB, available=3 * GIB)
    with pytest.raises(UsageError, match=r"3\.0 GiB free.*max_local_cpu_size.*VLLM_CPU"):
        cpu_kv_cache([], {}, busy, WEIGHTS, STORE)


@pytest.mark.parametrize("value", ["4", "1"])
def test_a_size_that_fits_is_the_users(value) -> None:
    assert cpu_kv_cache([], {KV_SPACE_ENV: value}, MACHINE, WEIGHTS, STORE) == ({}, None)


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("1.5", "whole number of GiB"),
        ("0", "whole number of GiB"),
        ("-2", "whole number of GiB"),
        ("lots", "whole number of GiB"),
        ("64", "more than the 20.0 GiB of memory free now: set at most 19"),
    ],
)
def test_a_size_that_cannot_work_is_refused(value, fragment) -> None:
    with pytest.raises(UsageError, match=fragment) as err:
        cpu_kv_cache([], {KV_SPACE_ENV: value}, MACHINE, WEIGHTS, STORE)
    assert KV_SPACE_ENV in str(err.value)


def test_vllms_own_memory_options_are_checked_or_left_to_it() -> None:
    assert cpu_kv_cache(["--kv-cache-memory-bytes", "2G"], {}, MACHINE, 0, 0) == ({}, None)
    assert cpu_kv_cache(["--gpu-memory-utilization=0.5"], {}, MACHINE, 0, 0) == ({}, None)
    with pytest.raises(UsageError, match="reserves that share of all 24.0 GiB"):
        cpu_kv_cache(["--gpu-memory-utilization", "0.9"], {}, MACHINE, 0, 0)
    for bad in ("0", "1.2", "half"):
        with pytest.raises(UsageError, match=r"expected a fraction in \(0, 1\]"):
            cpu_kv_cache(["--gpu-memory-utilization", bad], {}, MACHINE, 0, 0)


def test_option_values_in_either_form() -> None:
    argv = ["--port", "1", "--max-model-len=4096", "--port", "2"]
    assert serve_checks.option_value(argv, "--port") == "2"  # the last one counts
    assert serve_checks.option_value(argv, "--max-model-len") == "4096"
    assert serve_checks.option_value(argv, "--dtype") is None


def _model(tmp_path, layers: int = 4):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    return str(tmp_path)


def test_preflight_reads_the_users_connector_config(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(KV_SPACE_ENV, raising=False)
    model = _model(tmp_path)
    assert serve_checks.weights_bytes(model) == 1000

    def argv(extra: dict) -> list[str]:
        config = json.dumps({"kv_connector_extra_config": extra})
        return ["serve", model, "--kv-transfer-config", config]

    with pytest.raises(ConfigError, match="layer 9 does not exist: the model has 4 layers"):
        preflight(argv({"blend_check_layers": [9]}))
    # stats_file is the connector's own key, not a configuration key
    settings, message = preflight(argv({"blend_check_layers": [1], "stats_file": "s.jsonl"}))
    assert set(settings) == {"vllm_cpu_kvcache_space"} and message  # this machine has no GPU
    # the connector's own keys are checked too, before vLLM starts
    with pytest.raises(ConfigError, match=r"selected_attention \(from kv_connector_extra_config\)"):
        preflight(argv({"selected_attention": "fast"}))
    with pytest.raises(UsageError, match="kv_connector_extra_config is an object"):
        preflight(["serve", model, "--kv-transfer-config", '{"kv_connector_extra_config": 3}'])


def test_a_folder_that_holds_no_model_is_refused(tmp_path) -> None:
    from lmcache_backend.data.embedded import resolve_model

    with pytest.raises(FileNotFoundError, match="the folder holds no model"):
        resolve_model(str(tmp_path))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="a file that is not GGUF"):
        resolve_model(str(tmp_path / "notes.txt"))
    for text in ("/no/such", "./rel", "~/none-here", "a b", "x/y/z", "bad--id"):
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            resolve_model(text)
    assert resolve_model(_model(tmp_path)) == str(tmp_path)
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # left to the hub
