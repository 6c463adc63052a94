"""``blend_layers_per_step`` without an engine: the setting; the scheduler side of sliced
(asynchronous) loads (which claims are sliced, the load planned once the blocks are allocated,
the cancel of a request aborted while its blend is in flight); the worker side's pass budget
(oldest blend first, a fixed number of passes per step, cancels)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from fake_vllm_config import vllm_config

from lmcache_backend.config import ConfigError


@pytest.fixture
def settings_for(tmp_path, monkeypatch):
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.integration.vllm.settings import load_settings

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    try:
        path = str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))

    def make(**extra):
        base = {
            "enable_blending": True,
            "blend_min_tokens": 8,
            "blend_special_str": " # # ",
            "extra_config": {"segment_index_dir": str(tmp_path / "index")},
        }
        return load_settings(vllm_config(path, {**base, **extra}))

    return make


@pytest.mark.parametrize("value", [-1, 1.5, "two", True, None])
def test_bad_blend_layers_per_step_fails_start(settings_for, value) -> None:
    with pytest.raises(
        ConfigError, match=rf"blend_layers_per_step \(from .*\) = {value!r}: .* or 'auto'"
    ):
        settings_for(blend_layers_per_step=value)


@pytest.mark.parametrize("value", ["fast", 1, None, True])
def test_bad_selected_attention_fails_start(settings_for, value) -> None:
    with pytest.raises(
        ConfigError, match=rf"selected_attention \(from .*\) = {value!r}: expected one of"
    ):
        settings_for(selected_attention=value)


def test_selected_attention_defaults_to_auto(settings_for) -> None:
    assert settings_for().selected_attention == "auto"
    assert settings_for(selected_attention=" VLLM ").selected_attention == "vllm"
    assert settings_for(selected_attention="tiled").selected_attention == "tiled"


def test_blend_layers_per_step_defaults_to_auto(settings_for) -> None:
    """``auto`` slices claims of at least vLLM's step budget (8,192 tokens where the scheduler
    config does not say), 8 passes a step; a number slices every claim; 0 none."""
    default = settings_for()
    assert (default.blend_layers_per_step, default.slice_from_tokens) == (8, 8192)
    assert default.slicing_auto
    assert settings_for(blend_layers_per_step=" AUTO ").slicing_auto
    four = settings_for(blend_layers_per_step=4)
    assert (four.blend_layers_per_step, four.slice_from_tokens, four.slicing_auto) == (4, 0, False)
    assert settings_for(blend_layers_per_step="3").blend_layers_per_step == 3
    assert settings_for(blend_layers_per_step=0).blend_layers_per_step == 0


def test_auto_slicing_only_where_async_loads_were_checked(settings_for) -> None:
    from lmcache_backend.compat.vllm import SLICED_VERIFIED_RELEASE
    from lmcache_backend.integration.vllm.connector import _resolve_auto_slicing

    auto = settings_for()
    checked = SimpleNamespace(sliced_loads=True, release=SLICED_VERIFIED_RELEASE)
    assert _resolve_auto_slicing(auto, checked) == auto
    for other in (
        SimpleNamespace(sliced_loads=True, release="0.33.0"),
        SimpleNamespace(sliced_loads=False, release="0.10.0"),
    ):
        resolved = _resolve_auto_slicing(auto, other)
        assert (resolved.blend_layers_per_step, resolved.slice_from_tokens) == (0, 0)
    # a number the user chose is kept (and checked by the connector as before)
    four = settings_for(blend_layers_per_step=4)
    assert _resolve_auto_slicing(four, SimpleNamespace(sliced_loads=False, release="x")) == four


def test_auto_slices_claims_longer_than_one_vllm_step(settings_for) -> None:
    """A claim shorter than ``slice_from_tokens`` is blended at once, a longer one sliced."""
    import dataclasses

    settings = settings_for()
    short = _scheduler(settings)
    request = _request(settings)
    claimed = short.num_new_matched_tokens(request, 0)
    assert 0 < claimed < settings.slice_from_tokens and not short.is_sliced(request)
    low = dataclasses.replace(settings, slice_from_tokens=claimed)
    long = _scheduler(low)
    assert long.num_new_matched_tokens(_request(low, "s"), 0) == claimed
    assert long.is_sliced(_request(low, "s"))


def _scheduler(settings):
    from lmcache_backend.integration.vllm.scheduler_side.scheduler import SchedulerSide
    from lmcache_backend.models.fingerprint import ModelFingerprint

    fingerprint = ModelFingerprint("Llama", 30, 2, 2, 64, "rope", "float32", "w")
    scheduler = SchedulerSide(settings, fingerprint, profile=None)
    scheduler._cached = lambda keys: [True] * len(keys)  # every segment is held
    return scheduler


def _request(settings, rid="r", **params):
    sep = settings.separator.separator  # the default (auto) pattern's separator
    tokens = list(range(100, 140)) + list(sep.ids) + list(range(200, 240)) + list(sep.ids)
    tokens += list(range(300, 310))
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, kv_transfer_params=params)


def _output(new=(), cached_ids=()):
    return SimpleNamespace(
        num_scheduled_tokens={},
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached_ids)),
    )


def test_sliced_claim_is_planned_after_alloc_and_cancelled_on_abort(settings_for) -> None:
    settings = settings_for(blend_layers_per_step=4)
    scheduler = _scheduler(settings)
    request = _request(settings)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    assert claimed > 0 and scheduler.is_sliced(request)
    scheduler.after_alloc(request, claimed, [7, 8, 9])
    meta = scheduler.build(_output())
    (load,) = meta.loads
    assert load.sliced and load.block_ids == [7, 8, 9] and load.end == claimed
    assert meta.cancels == []
    # nothing planned twice; an abort while in flight is sent once
    assert scheduler.build(_output()).loads == []
    scheduler.finished(request)
    assert scheduler.build(_output()).cancels == ["r"]
    assert scheduler.build(_output()).cancels == []


def test_a_finished_load_is_not_cancelled(settings_for) -> None:
    settings = settings_for(blend_layers_per_step=4)
    scheduler = _scheduler(settings)
    request = _request(settings)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    scheduler.after_alloc(request, claimed, [1, 2, 3])
    scheduler.build(_output())
    scheduler.loads_finished({"r"})
    # vLLM schedules the tail: update_state_after_alloc comes again with 0 tokens
    scheduler.after_alloc(request, 0)
    new = SimpleNamespace(
        req_id="r",
        prompt_token_ids=request.prompt_token_ids,
        block_ids=([1, 2, 3, 4],),
        num_computed_tokens=claimed,
    )
    meta = scheduler.build(_output(new=[new]))
    assert meta.loads == [] and [s.req_id for s in meta.saves] == []
    scheduler.finished(request)
    assert scheduler.build(_output()).cancels == []


def test_abort_before_the_plan_still_reaches_the_workers(settings_for) -> None:
    """vLLM frees a request aborted in WAITING_FOR_REMOTE_KVS only once a worker reports it:
    the load and its cancel go out together."""
    settings = settings_for(blend_layers_per_step=4)
    scheduler = _scheduler(settings)
    request = _request(settings)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    scheduler.after_alloc(request, claimed, [1, 2, 3])
    scheduler.finished(request)
    meta = scheduler.build(_output())
    assert [s.req_id for s in meta.loads] == ["r"] and meta.cancels == ["r"]
    assert scheduler.build(_output()).cancels == []


@pytest.mark.parametrize(
    "per_step, params, sliced",
    [
        (0, {}, False),  # the default: synchronous
        (4, {}, True),  # the default selection previews
        (4, {"blend_selection": "query_preview"}, True),
        (4, {"blend_selection": "kv_deviation"}, False),  # check layers compute the tail
        (4, {"blend_selection": "query_attention"}, False),
    ],
)
def test_only_tail_free_selections_are_sliced(settings_for, per_step, params, sliced) -> None:
    settings = settings_for(blend_layers_per_step=per_step)
    scheduler = _scheduler(settings)
    request = _request(settings, **params)
    claimed = scheduler.num_new_matched_tokens(request, 0)
    assert claimed > 0 and scheduler.is_sliced(request) is sliced
    scheduler.after_alloc(request, claimed, [1, 2, 3])
    new = SimpleNamespace(
        req_id="r",
        prompt_token_ids=request.prompt_token_ids,
        block_ids=([1, 2, 3, 4],),
        num_computed_tokens=claimed,
    )
    meta = scheduler.build(_output(new=[] if sliced else [new]))
    assert [(s.req_id, s.sliced) for s in meta.loads] == [("r", sliced)]


def _worker(layers: int, per_step: int):
    """The worker's loads (:class:`~lmcache_backend.integration.vllm.worker_side.loads.Loads`) of a
    model of ``layers`` layers; ``finished`` collects ``(request id, result)`` of completed
    blends."""
    from lmcache_backend.integration.vllm.worker_side.loads import Loads

    finished: list = []

    def done(spec, result, *rest):
        finished.append((spec.req_id, result))

    loads = Loads(None, None, None, 16, per_step, False, done)
    loads.finished, loads.last_layer = finished, layers - 1
    return loads


def _job(worker, rid: str, layers: int, preview: bool | str, log: list):
    """A sliced job of ``layers`` blend passes after ``preview``: False (none), True (a preview
    layer by layer: ``layers`` passes) or ``"engine"`` (one pass, vLLM's forward)."""
    from lmcache_backend.integration.vllm.worker_side.loads import _Sliced

    writer = SimpleNamespace(paged_layers=0, engine_previewed=False)

    def passes():
        if preview == "engine":
            writer.engine_previewed = True
            log.append((rid, "preview", layers - 1))
            yield "preview", layers - 1
        for kind in ("preview", "blend") if preview is True else ("blend",):
            for layer in range(layers):
                log.append((rid, kind, layer))
                yield kind, layer
        return f"result of {rid}"

    spec = SimpleNamespace(req_id=rid)
    from lmcache_backend.blend.timing import NO_TIMER

    job = _Sliced(spec, passes(), writer, NO_TIMER, 0.0)
    worker.sliced[rid] = job
    return job


def _advance_steps(worker, log: list, steps: int) -> list:
    """``steps`` engine steps of ``worker``: per step, the passes run and the loads it reports
    finished (sorted request ids)."""
    counts: list = []
    for _ in range(steps):
        before = len(log)
        worker.advance(worker.last_layer)
        counts.append(len(log) - before)
        done = worker.take_finished()
        counts.append(sorted(done) if done else [])
    return counts


def test_worker_runs_a_fixed_number_of_passes_per_step_oldest_first() -> None:
    worker, log = _worker(layers=4, per_step=3), []
    a = _job(worker, "a", 4, preview=True, log=log)  # 8 passes
    _job(worker, "b", 4, preview=False, log=log)  # 4 passes
    counts = _advance_steps(worker, log, 4)
    # 3 passes a step; "a" completes in its third step (then "b" gets the rest of the budget)
    assert counts == [3, [], 3, [], 3, ["a"], 3, ["b"]]
    assert [rid for rid, _ in worker.finished] == ["a", "b"]
    assert worker.finished[0][1] == "result of a" and a.steps == 3
    assert not worker.sliced


def test_a_preview_through_vllms_forward_ends_its_step() -> None:
    """The engine's preview is one pass but costs about as much as a few blend layers: the step
    that ran it runs nothing more, whatever budget is left."""
    worker, log = _worker(layers=4, per_step=3), []
    a = _job(worker, "a", 4, preview="engine", log=log)  # 1 + 4 passes
    _job(worker, "b", 4, preview=False, log=log)  # 4 passes
    counts = _advance_steps(worker, log, 4)
    assert counts == [1, [], 3, [], 3, ["a"], 2, ["b"]]
    assert log[0] == ("a", "preview", 3) and a.steps == 3
    assert not worker.sliced


def test_worker_finishes_a_blend_whose_last_layer_used_the_budget() -> None:
    worker, log = _worker(layers=4, per_step=4), []
    job = _job(worker, "a", 4, preview=False, log=log)
    worker.advance(worker.last_layer)
    assert worker.take_finished() == {"a"} and job.steps == 1


def test_worker_cancel_drops_the_blend_before_it_advances() -> None:
    worker, log = _worker(layers=4, per_step=2), []
    _job(worker, "a", 4, preview=True, log=log)
    worker.advance(worker.last_layer)
    assert worker.take_finished() is None
    worker.cancel("a")
    worker.cancel("unknown")  # completed (and reported) earlier, or never here: nothing
    worker.advance(worker.last_layer)
    assert len(log) == 2 and not worker.sliced and not worker.finished
    assert worker.take_finished() == {"a"}  # vLLM frees the blocks only then
    assert worker.take_finished() is None


def test_a_step_before_the_model_is_built_advances_nothing() -> None:
    """On releases that create the connector before loading the model (vLLM 0.9.2-0.11), the
    first steps reach ``start_load_kv`` with no load planned and no model yet: advancing the
    (absent) sliced blends and asking for finished loads must not touch the model."""
    from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide

    worker = WorkerSide(
        SimpleNamespace(config=SimpleNamespace(backend="torch"), tp_size=1),
        SimpleNamespace(cache_config=SimpleNamespace(block_size=16)),
        SimpleNamespace(kv_transfer_after_model_load=False),
    )
    worker.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(1)})
    assert worker.model is None
    worker.advance()
    worker.cancel("never-started")
    worker.finish_step()
    assert worker.take_finished_loads() is None and worker.model is None
