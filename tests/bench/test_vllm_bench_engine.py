"""The benchmark's vLLM engine on the embedded model: each strategy's answer and teacher-forced
answers (the forced-answer logits processor) computed over the K/V its prefill computed, and a
reset that leaves the segments stored before it out of reach."""

from __future__ import annotations

import os

import pytest
from vllm_scripts import BLEND_ENV, run_result_script

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

SCRIPT = """
import json
from lmcache_backend.bench.quality.metrics import kl_divergence
from lmcache_backend.bench.quality.strategies import BLEND, FULL, Strategy
from lmcache_backend.bench.quality.vllm_engine import VLLMEngine
from lmcache_backend.data.embedded import embedded_model_path
from lmcache_backend.data.examples import builtin_examples, reordered
from lmcache_backend.integration.vllm.offline import read_records


def main():
    engine = VLLMEngine(str(embedded_model_path()))
    ex = builtin_examples(1, chunks_per_example=4)[0]
    asked = engine.prompt_ids(ex.system, reordered(ex.chunks, 0), ex.question)
    engine.reset()
    engine.warm(engine.prompt_ids(ex.system, ex.chunks, "Summarize the documents."))
    out = {}
    blend = Strategy("blend", BLEND, ratios=(0.15,), check_layers=(1,))
    for strategy in (Strategy("full", FULL), blend):
        before = len(read_records(engine._stats))
        run = engine.prefill(strategy, asked, timed=False)
        answer = engine.decode(asked, run, 8)
        forced = engine.forced_logits(asked, run, answer.token_ids)
        # another answer: its first token, then tokens the model would not choose
        other = answer.token_ids[:1] + [(t + 7) % 1000 + 100 for t in answer.token_ids[1:4]]
        forced_other = engine.forced_logits(asked, run, other)
        out[strategy.name] = {
            "answer": answer.token_ids,
            "argmax": [int(row.argmax()) for row in forced],
            "first_kl": kl_divergence(run.logits, forced[0]),
            "other_first_kl": kl_divergence(forced[0], forced_other[0]),
            "other_rows": list(forced_other.shape),
            "blends": len(read_records(engine._stats)) - before,
        }
    # a reset starts a new cache salt: the segments stored before are out of reach
    engine.reset()
    again = engine.prefill(blend, asked, timed=False)
    out["after reset"] = {"reused": again.reused_tokens, "fallback": again.fallback_reason}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
"""


def test_answers_read_each_strategys_own_kv_and_force_exactly(tmp_path):
    try:
        from lmcache_backend.data.embedded import embedded_model_path

        embedded_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env = {**env, **BLEND_ENV, "LMCACHE_BLEND_MIN_TOKENS": "0"}
    result = run_result_script(script, [], env, timeout=900)
    after_reset = result.pop("after reset")
    assert after_reset["reused"] == 0 and after_reset["fallback"], after_reset
    for name, got in result.items():
        assert len(got["answer"]) >= 2, name
        # teacher-forced along its own greedy answer, each step's argmax is that answer's token
        assert got["argmax"] == got["answer"], name
        # the forced request reads the prefill's K/V: its first distribution is the prefill's
        assert got["first_kl"] < 1e-3, (name, got["first_kl"])
        assert got["other_first_kl"] < 1e-3, (name, got["other_first_kl"])
        # tokens the model would not choose came out (else forced_logits raises)
        assert got["other_rows"][0] == 4, name
    # the prefill, the answer and both forced answers each blended (the same way: first_kl);
    # full prefill never blends
    assert result["blend"]["blends"] == 4 and result["full"]["blends"] == 0
