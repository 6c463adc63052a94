"""The connector's scheduler side finds the same cached units as the HF engine (one pattern, one
key function), for text prompts, with a separator and without; a bad setting fails start-up."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from fake_vllm_config import vllm_config

from lmcache_backend.config import ConfigError


@pytest.fixture(scope="module")
def smol():
    from lmcache_backend.data.embedded import load_embedded_model

    torch.set_num_threads(2)
    return load_embedded_model()


def _chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("sep", [" # # ", ""], ids=["separator", "separator-free"])
def test_scheduler_and_hf_engine_share_the_split(smol, sep, tmp_path, monkeypatch) -> None:
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.data.examples import builtin_examples
    from lmcache_backend.integration.hf.engine import HFBlendEngine
    from lmcache_backend.integration.vllm.scheduler_side.scheduler import SchedulerSide
    from lmcache_backend.integration.vllm.settings import load_settings
    from lmcache_backend.storage.lookup.index import FileSegmentIndex

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    model, tok = smol
    extra = {
        "enable_blending": True,
        "blend_special_str": sep,
        "blend_min_tokens": 32,
        "extra_config": {"segment_index_dir": str(tmp_path / "index")},
    }
    settings = load_settings(vllm_config(str(embedded_model_path()), dict(extra)))
    engine = HFBlendEngine(model, tok, settings.config)
    assert settings.separator == engine.separator

    ex = builtin_examples(1, chunks_per_example=4)[0]
    if sep:
        from lmcache_backend.blend.segmenting import chat_messages

        first = _chat_ids(tok, chat_messages(ex.system, ex.chunks, ex.question))
        second = _chat_ids(tok, chat_messages(ex.system, ex.chunks[::-1], "Which one?"))
    else:
        system = [{"role": "system", "content": ex.system}]
        first = _chat_ids(
            tok,
            system + [{"role": "user", "content": c} for c in ex.chunks + [ex.question]],
        )
        second = _chat_ids(
            tok,
            system + [{"role": "user", "content": c} for c in ex.chunks[::-1] + ["Which one?"]],
        )
    engine.warm(first)
    # the worker's index, as the scheduler sees it: one marker per stored key
    index = FileSegmentIndex(tmp_path / "index")
    cache = engine.segment_cache
    for seg, held in cache.cached(first):
        assert held
        index.add(cache.key(first, seg))
    hits = cache.match(second)
    assert hits and all(s.end <= cache.query_start(second) for s in hits)

    scheduler = SchedulerSide(settings, engine.adapter.fingerprint, profile=None)
    request = SimpleNamespace(request_id="r", prompt_token_ids=second, kv_transfer_params=None)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    # up to the question (after the last separator, or the last block found), which vLLM
    # computes (never served from the store, never claimed)
    assert claimed == cache.pattern.claim_end(second, hits) < len(second) - 1
    assert "Which one?" in tok.decode(second[claimed:])
    assert scheduler.requests["r"].claim.reusable == sum(len(s) for s in hits)
    # a prefix hit reaching into the question leaves the connector nothing to claim
    assert scheduler.num_new_matched_tokens(request, claimed) == 0
    # and the blender finds exactly those tokens
    result = engine.blend_prefill(second).blend
    assert result.num_reusable == sum(len(s) for s in hits)


def test_bad_block_size_fails_connector_start(tmp_path) -> None:
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.integration.vllm.settings import load_settings

    config = vllm_config(str(embedded_model_path()), {"blend_block_size": 0})
    with pytest.raises(ConfigError, match="blend_block_size"):
        load_settings(config)


def test_lora_with_blending_fails_connector_start() -> None:
    """Cached K/V carry no adapter identity: an engine with LoRA and blending on is refused at
    start-up, naming both settings; with blending off the connector starts."""
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.integration.vllm.settings import load_settings

    try:
        path = str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    config = vllm_config(path, {"enable_blending": True})
    config.lora_config = SimpleNamespace(max_loras=1)
    with pytest.raises(ConfigError, match="enable_blending=True.*enable_lora"):
        load_settings(config)
    config = vllm_config(path, {"enable_blending": False})
    config.lora_config = SimpleNamespace(max_loras=1)
    assert load_settings(config).config.enable_blending is False
