"""CacheBlendConnector with tensor parallelism on the CPU build: 3 ranks (SmolLM2 has 3 KV heads).

Three worker processes on 2 cores: about 3 minutes, bounded by the child's timeout. The engine
runs in a child process (its own ``__main__``), which prints one JSON result line. Set
``LMCACHE_BACKEND_SKIP_TP=1`` to leave it out.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from vllm_scripts import run_result_script

pytest.importorskip("vllm")
if os.environ.get("LMCACHE_BACKEND_SKIP_TP") == "1":
    pytest.skip("LMCACHE_BACKEND_SKIP_TP=1", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.data.examples import builtin_examples
    from lmcache_backend.blend.segmenting import build_blend_prompt, separator_pattern
    from lmcache_backend.integration.vllm.offline import offline_engine

    def params(**kw):
        extra = {"kv_transfer_params": kw} if kw else None
        return SamplingParams(temperature=0, max_tokens=10, extra_args=extra)

    if __name__ == "__main__":
        path = str(embedded_model_path())
        tok = AutoTokenizer.from_pretrained(path)
        ex = builtin_examples(1, chunks_per_example=3)[0]
        first = build_blend_prompt(tok, ex.system, ex.chunks, ex.question).token_ids
        again = build_blend_prompt(tok, ex.system, ex.chunks[::-1], ex.question).token_ids
        llm = offline_engine(path, stats_file=sys.argv[1], tensor_parallel_size=3,
                             extra_config={"blend_layers_per_step": int(sys.argv[2])},
                             max_model_len=2048)
        run = lambda ids, p: llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)[0]
        warm = run(first, params())
        plain = run(again, params(blend=False))
        full = run(again, params(blend_recompute_ratios=[1.0]))
        part = run(again, params())
        print("RESULT " + json.dumps({
            "n": len(again), "warm_cached": warm.num_cached_tokens,
            "tail": separator_pattern(tok, " # # ").query_start(again),
            "plain": plain.outputs[0].text, "full": full.outputs[0].text,
            "full_cached": full.num_cached_tokens, "part_cached": part.num_cached_tokens,
            "part": part.outputs[0].text,
        }))
    """
)


_PART: dict[int, tuple[str, str]] = {}  # blend_layers_per_step -> (answer, selected_digest)


@pytest.mark.parametrize("layers_per_step", [0, 8], ids=["synchronous", "sliced"])
def test_three_ranks_blend_consistently(tmp_path, layers_per_step) -> None:
    """With ``blend_layers_per_step`` the ranks run the same passes per step (a fixed count):
    they select the same tokens, and the answer and selection are the synchronous blend's."""
    (tmp_path / "tp.py").write_text(SCRIPT)
    stats = tmp_path / "blend.jsonl"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "LMCACHE_ENABLE_BLENDING": "true",
        "LMCACHE_BLEND_MIN_TOKENS": "32",
        "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15",
    }
    args = [str(stats), str(layers_per_step)]
    out = run_result_script(tmp_path / "tp.py", args, env, timeout=540)
    assert out["warm_cached"] == 0
    # claimed up to the question, which vLLM computes
    assert out["full_cached"] == out["part_cached"] == out["tail"] < out["n"] - 1
    assert out["full"] == out["plain"], "ratio 1.0 must reproduce vLLM's prefill on 3 ranks"
    assert out["part"].strip()
    lines = [json.loads(x) for x in stats.read_text().splitlines()]
    records = [r for r in lines if r.get("blended", True)]  # blends only
    # one record per rank and request; the ranks must select the same tokens
    by_request: dict[str, list] = {}
    for r in records:
        by_request.setdefault(r["req_id"], []).append(r)
    assert len(records) == 6 and len(by_request) == 2, records
    for rows in by_request.values():
        assert len({r["selected_digest"] for r in rows}) == 1, rows
        assert len({r["recomputed_reusable"] for r in rows}) == 1, rows
    # the reordered prompt blended at 0.15 on every rank
    part = [rows for rows in by_request.values() if rows[0]["recompute_fraction"] < 1.0]
    assert len(part) == 1, records
    assert all(0.14 <= r["recompute_fraction"] <= 0.17 for r in part[0]), part
    steps = {r["blend_steps"] for r in part[0]}
    # sliced: the preview through vLLM's forward (a step of its own), then the 30 layers
    assert steps == ({1} if layers_per_step == 0 else {1 + -(-30 // layers_per_step)}), part
    _PART[layers_per_step] = (out["part"], part[0][0]["selected_digest"])
    if layers_per_step and 0 in _PART:
        assert _PART[layers_per_step] == _PART[0], "the sliced blend is the synchronous one"
