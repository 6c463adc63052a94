"""The HF benchmark engine's teacher-forced answers (the KL along full prefill's answer) on the
embedded SmolLM2, against the model's own forward pass over the prompt and the answer (fp32
precision)."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close, relative_error

from lmcache_backend.bench.quality.strategies import BLEND, FULL, Strategy
from lmcache_backend.data.examples import builtin_examples, reordered

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from lmcache_backend.bench.quality.hf_engine import HFEngine
    from lmcache_backend.config import load_config
    from lmcache_backend.data.embedded import load_embedded_model

    try:
        model, tokenizer = load_embedded_model()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return HFEngine(model, tokenizer, load_config(enable_blending=True, blend_min_tokens=0))


def _asked(engine):
    ex = builtin_examples(1, chunks_per_example=4)[0]
    engine.reset()
    engine.warm(engine.prompt_ids(ex.system, ex.chunks, "Summarize the documents."))
    return engine.prompt_ids(ex.system, reordered(ex.chunks, 0), ex.question)


def test_forced_answer_is_the_forward_pass_over_prompt_and_answer(engine):
    asked = _asked(engine)
    run = engine.prefill(Strategy("full", FULL), asked, timed=False)
    answer = engine.decode(asked, run, 6).token_ids
    other = answer[:1] + [(t + 7) % 1000 + 100 for t in answer[1:4]]  # not the model's choice
    for forced_ids in (answer, other):
        forced = engine.forced_logits(asked, run, forced_ids)
        with torch.no_grad():
            ids = torch.tensor([asked + forced_ids[:-1]])
            reference = engine.model(input_ids=ids).logits[0, len(asked) - 1 :].float()
        assert forced.shape == (len(forced_ids), reference.shape[-1])
        # one pass against a prefill plus a pass over its cache: 30 layers summed in another
        # order, so elementwise fp32 tolerances are too tight; the whole rows agree to fp32
        assert relative_error(forced, reference) < 1e-5
    # along its own greedy answer every step's argmax is that answer's token
    assert [int(r.argmax()) for r in engine.forced_logits(asked, run, answer)] == answer


def test_forced_answer_reads_the_blends_kv(engine):
    asked = _asked(engine)
    run = engine.prefill(Strategy("blend", BLEND, ratios=(0.15,), check_layers=(1,)), asked)
    assert run.reused_tokens > 0
    answer = engine.decode(asked, run, 6).token_ids
    forced = engine.forced_logits(asked, run, answer)
    assert_close(forced[0], run.logits, torch.float32)  # the blend's own first distribution
    assert [int(r.argmax()) for r in forced] == answer  # decoded over the same K/V
