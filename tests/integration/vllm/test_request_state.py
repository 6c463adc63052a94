"""The scheduler side keeps one record per request, created when vLLM first asks about the
request and removed when it finishes or is aborted: whatever path the request took (claimed,
left to vLLM, sliced and aborted, preempted and resumed), nothing of it is left behind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_sliced_blend import _request, settings_for  # noqa: F401 - fixture

from lmcache_backend.models.fingerprint import ModelFingerprint


def _scheduler(settings):
    """A scheduler whose store holds every segment; vLLM's ``resumed`` flag read from the
    step's output (``cached.resumed``)."""
    from lmcache_backend.integration.vllm.scheduler_side.scheduler import SchedulerSide

    fingerprint = ModelFingerprint("Llama", 30, 2, 2, 64, "rope", "float32", "w")
    release = SimpleNamespace(resumed=lambda cached, i: cached.resumed[i])
    scheduler = SchedulerSide(settings, fingerprint, release)
    scheduler._cached = lambda keys: [True] * len(keys)
    return scheduler


def _step(new=(), cached=(), scheduled=None):
    """vLLM's scheduler output: ``new`` requests ``(request, blocks, computed)``, ``cached``
    ones ``(rid, new blocks, computed, resumed)``; every request is scheduled to its end."""
    new_reqs = [
        SimpleNamespace(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            block_ids=(blocks,),
            num_computed_tokens=computed,
        )
        for r, blocks, computed in new
    ]
    scheduled = scheduled or {r.request_id: 10_000 for r, _, _ in new}
    scheduled.update({rid: 10_000 for rid, *_ in cached if rid not in scheduled})
    return SimpleNamespace(
        num_scheduled_tokens=scheduled,
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[(c[1],) if c[1] else None for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed=[c[3] for c in cached],
        ),
    )


def test_a_claimed_request_leaves_nothing_when_it_finishes(settings_for) -> None:  # noqa: F811
    settings = settings_for(blend_layers_per_step=0)
    scheduler = _scheduler(settings)
    request = _request(settings)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    assert claimed > 0 and list(scheduler.requests) == ["r"]
    scheduler.after_alloc(request, claimed)
    meta = scheduler.build(_step(new=[(request, [1, 2, 3, 4], claimed)]))
    assert [s.req_id for s in meta.loads] == ["r"] and [s.req_id for s in meta.saves] == ["r"]
    state = scheduler.requests["r"]
    assert state.claim is None and state.prompt is None  # loaded once, stored once
    scheduler.finished(request)
    assert scheduler.requests == {}
    scheduler.finished(request)  # vLLM reports a request once; a second report changes nothing
    assert scheduler.requests == {}
    assert scheduler.take_metrics().data["counters"]["vllm:cacheblend_requests_claimed"]


@pytest.mark.parametrize("params", [{"blend": False}, {"blend": "off"}, {}])
def test_a_request_left_to_vllm_leaves_nothing(settings_for, params) -> None:  # noqa: F811
    settings = settings_for(blend_layers_per_step=0, blend_min_tokens=10_000)
    scheduler = _scheduler(settings)
    request = _request(settings, **params)
    assert scheduler.num_new_matched_tokens(request, 0) == 0
    reason = "opted out" if params else "below blend_min_tokens"
    assert scheduler.requests["r"].left_to_vllm == reason
    meta = scheduler.build(_step(new=[(request, [1, 2, 3, 4], 0)]))
    assert meta.loads == [] and [s.req_id for s in meta.saves] == ["r"]
    scheduler.finished(request)
    assert scheduler.requests == {}


def test_a_lora_request_is_neither_stored_nor_kept(settings_for) -> None:  # noqa: F811
    settings = settings_for(blend_layers_per_step=0)
    scheduler = _scheduler(settings)
    request = _request(settings)
    request.lora_request = object()
    assert scheduler.num_new_matched_tokens(request, 0) == 0
    meta = scheduler.build(_step(new=[(request, [1, 2, 3, 4], 0)]))
    assert meta.saves == []
    scheduler.finished(request)
    assert scheduler.requests == {}


@pytest.mark.parametrize("planned", [True, False])
def test_an_aborted_sliced_load_is_cancelled_and_forgotten(settings_for, planned) -> None:  # noqa: F811
    settings = settings_for(blend_layers_per_step=4)
    scheduler = _scheduler(settings)
    request = _request(settings)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    scheduler.after_alloc(request, claimed, [7, 8, 9])
    if planned:
        assert [s.req_id for s in scheduler.build(_step()).loads] == ["r"]
    scheduler.finished(request)
    assert scheduler.requests == {}
    meta = scheduler.build(_step())
    assert meta.cancels == ["r"]
    assert [s.req_id for s in meta.loads] == ([] if planned else ["r"])
    # the workers report the cancelled load: nothing to update, nothing comes back
    scheduler.loads_finished({"r"})
    assert scheduler.requests == {} and scheduler.build(_step()).cancels == []


def test_preemption_blends_again_and_leaves_nothing_at_the_end(settings_for) -> None:  # noqa: F811
    settings = settings_for(blend_layers_per_step=0)
    scheduler = _scheduler(settings)
    request = _request(settings)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    scheduler.after_alloc(request, claimed)
    first = scheduler.build(_step(new=[(request, [1, 2, 3, 4], claimed)]))
    assert [s.block_ids for s in first.loads] == [[1, 2, 3, 4]]
    assert scheduler.requests["r"].prompt is None  # stored: no longer followed
    # preempted while decoding: vLLM asks again, the claim is made anew
    assert scheduler.num_new_matched_tokens(request, 0) == claimed
    assert len(scheduler.requests) == 1
    scheduler.after_alloc(request, claimed)
    resumed = scheduler.build(_step(cached=[("r", [5, 6, 7, 8], claimed, True)]))
    assert [(s.req_id, s.block_ids) for s in resumed.loads] == [("r", [5, 6, 7, 8])]
    assert [s.block_ids for s in resumed.saves] == [[5, 6, 7, 8]]
    state = scheduler.requests["r"]
    assert state.claim is None and state.prompt is None
    # decoding on: nothing more is planned for it
    later = scheduler.build(_step(cached=[("r", None, len(request.prompt_token_ids), False)]))
    assert later.loads == [] and later.saves == []
    scheduler.finished(request)
    assert scheduler.requests == {}


def test_preemption_during_prefill_follows_the_new_blocks(settings_for) -> None:  # noqa: F811
    settings = settings_for(blend_layers_per_step=0, blend_min_tokens=10_000)
    scheduler = _scheduler(settings)
    request = _request(settings)
    n = len(request.prompt_token_ids)
    assert scheduler.num_new_matched_tokens(request, 0) == 0
    meta = scheduler.build(_step(new=[(request, [1], 0)], scheduled={"r": 16}))
    assert meta.saves == [] and scheduler.requests["r"].prompt.block_ids == [1]
    # preempted before its prompt was complete, then resumed into other blocks
    assert scheduler.num_new_matched_tokens(request, 0) == 0
    meta = scheduler.build(_step(cached=[("r", [9, 10, 11, 12], 0, True)]))
    assert [(s.req_id, s.block_ids, len(s.token_ids)) for s in meta.saves] == [
        ("r", [9, 10, 11, 12], n)
    ]
    scheduler.finished(request)
    assert scheduler.requests == {}
