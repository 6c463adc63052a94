"""The scheduler side keys every lookup with the request's ``cache_salt`` and hands the salt to
the workers in its ``LoadSpec`` and ``SaveSpec``; a LoRA request is neither claimed nor stored."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from fake_vllm_config import vllm_config

from lmcache_backend.storage.lookup.index import FileSegmentIndex


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.integration.vllm.scheduler_side.scheduler import SchedulerSide
    from lmcache_backend.integration.vllm.settings import load_settings
    from lmcache_backend.models.fingerprint import ModelFingerprint

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    try:
        path = str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    extra = {
        "enable_blending": True,
        "blend_min_tokens": 4,
        "extra_config": {"segment_index_dir": str(tmp_path / "index")},
    }
    settings = load_settings(vllm_config(path, extra))
    fp = ModelFingerprint("TestLM", 30, 9, 3, 64, "rope", "float32", "w")
    side = SchedulerSide(settings, fp, profile=SimpleNamespace(resumed=lambda c, i: False))
    side.index = FileSegmentIndex(tmp_path / "index")  # the worker's, as the scheduler sees it
    return side


def _prompt(side) -> list[int]:
    sep = list(side.settings.separator.separator.ids)  # the default separator's ids (auto)
    return [11, 12, 13, 14, *sep, 21, 22, 23, 24, *sep, 31, 32]


def _hold(side, tokens: list[int], salt: str | None) -> None:
    """Mark the prompt's segments as held under ``salt`` (what the worker's saver does)."""
    from lmcache_backend.storage.segments import segment_keys

    units = side.settings.separator.store_units(tokens)
    spans = [(s.start, s.end) for s in units]
    for key in segment_keys(side.fingerprint, tokens, spans, salt):
        side.index.add(key)


def _request(rid: str, tokens: list[int], salt=None, lora=None):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        kv_transfer_params=None,
        cache_salt=salt,
        lora_request=lora,
    )


def _step(side, requests: list) -> object:
    """A step that schedules the rest of each request's prompt after what was claimed (vLLM
    counts the claimed tokens as computed)."""
    new = [
        SimpleNamespace(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            block_ids=([0],),
            num_computed_tokens=side.requests[r.request_id].claim.end
            if side.requests[r.request_id].claim is not None
            else 0,
        )
        for r in requests
    ]
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    output = SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in requests},
    )
    return side.build(output)


def test_claims_only_segments_of_the_requests_own_salt(scheduler) -> None:
    tokens = _prompt(scheduler)
    _hold(scheduler, tokens, "tenant-A")
    a, b, none = (
        _request("a", tokens, "tenant-A"),
        _request("b", tokens, "tenant-B"),
        _request("n", tokens),
    )
    assert scheduler.num_new_matched_tokens(a, 0) > 0
    assert scheduler.num_new_matched_tokens(b, 0) == 0
    assert scheduler.num_new_matched_tokens(none, 0) == 0
    meta = _step(scheduler, [a, b, none])
    assert [(s.req_id, s.cache_salt) for s in meta.loads] == [("a", "tenant-A")]
    saves = {s.req_id: s.cache_salt for s in meta.saves}
    assert saves == {"a": "tenant-A", "b": "tenant-B", "n": None}


def test_an_empty_salt_is_no_salt(scheduler) -> None:
    tokens = _prompt(scheduler)
    _hold(scheduler, tokens, None)
    assert scheduler.num_new_matched_tokens(_request("e", tokens, ""), 0) > 0
    (load,) = _step(scheduler, [_request("e", tokens, "")]).loads
    assert load.cache_salt is None


def test_a_lora_request_is_neither_claimed_nor_stored(scheduler) -> None:
    tokens = _prompt(scheduler)
    _hold(scheduler, tokens, None)
    lora = _request("l", tokens, lora=SimpleNamespace(lora_name="adapter", lora_int_id=1))
    assert scheduler.num_new_matched_tokens(lora, 0) == 0
    meta = _step(scheduler, [lora])
    assert meta.loads == [] and meta.saves == []


@pytest.mark.parametrize("blend", [True, False])
def test_skip_save_keeps_a_request_out_of_the_store(scheduler, blend, caplog) -> None:
    """LMCache's ``lmcache.skip_save``: a request that asks for it still reuses what the store
    holds (unless it opts out of blending) and is never stored; an invalid value is a warning
    naming the request, and the request is stored as usual."""
    tokens = _prompt(scheduler)
    _hold(scheduler, tokens, None)
    skip = _request("s", tokens)
    skip.kv_transfer_params = {"lmcache.skip_save": True, "blend": blend}
    stored = _request("k", tokens)
    bad = _request("x", tokens)
    bad.kv_transfer_params = {"lmcache.skip_save": "sometimes"}
    assert (scheduler.num_new_matched_tokens(skip, 0) > 0) is blend
    scheduler.num_new_matched_tokens(stored, 0)
    scheduler.num_new_matched_tokens(bad, 0)
    meta = _step(scheduler, [skip, stored, bad])
    assert sorted(s.req_id for s in meta.saves) == ["k", "x"]
    assert ("s" in [load.req_id for load in meta.loads]) is blend
    assert "request x: ignoring lmcache.skip_save (from kv_transfer_params) = 'sometimes'" in (
        caplog.text
    )
