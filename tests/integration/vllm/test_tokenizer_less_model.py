"""A model vLLM serves without a tokenizer (``skip_tokenizer_init=True``, prompts sent as token
ids, a model folder with no tokenizer files): the connector starts where its segmentation needs
no tokenizer. Found running vLLM 0.26.0's engine from the hardware check's bundle: the settings
loaded the tokenizer whatever the segmentation, so a tokenizer-less model could not start the
connector even with ``blend_segmentation=blocks``."""

from __future__ import annotations

import json
import logging
import os

import pytest
from fake_vllm_config import vllm_config

from lmcache_backend.blend.segments.patterns import BlockPattern
from lmcache_backend.config import ConfigError
from lmcache_backend.integration.vllm.settings import load_settings


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A model folder with a config.json and no tokenizer; no LMCACHE_* variables."""
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def _config(folder, segmentation: str | None, skip: bool = True):
    extra = {"enable_blending": True, "extra_config": {"segment_index_dir": str(folder / "i")}}
    if segmentation:
        extra["blend_segmentation"] = segmentation
    config = vllm_config(str(folder), extra, num_layers=2)
    config.model_config.skip_tokenizer_init = skip
    return config


def test_blocks_need_no_tokenizer(folder):
    settings = load_settings(_config(folder, "blocks"))
    assert isinstance(settings.separator, BlockPattern)


def test_auto_cuts_in_blocks_and_says_why(folder, caplog):
    with caplog.at_level(logging.WARNING):
        settings = load_settings(_config(folder, None))
    assert isinstance(settings.separator, BlockPattern)
    assert "skip_tokenizer_init" in caplog.text and "blocks" in caplog.text


def test_a_separator_without_a_tokenizer_is_one_line_naming_the_key(folder):
    with pytest.raises(ConfigError, match=r"blend_segmentation.*separator.*set blend_segmentation"):
        load_settings(_config(folder, "separator"))


def test_a_missing_tokenizer_still_fails_where_vllm_loads_one(folder):
    """Without skip_tokenizer_init vLLM itself needs the tokenizer: nothing is papered over."""
    with pytest.raises(Exception) as caught:
        load_settings(_config(folder, None, skip=False))
    assert not isinstance(caught.value, ConfigError)
