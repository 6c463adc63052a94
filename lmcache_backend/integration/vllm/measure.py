"""Time to first token of CacheBlend vs vLLM's full prefill, in one vLLM engine.

``python -m lmcache_backend.integration.vllm.measure [--chunks 4] [--chunk-repeat 3] [--ratio
0.15] [--examples 4]`` builds RAG prompts from the built-in examples (each chunk repeated
``--chunk-repeat`` times to make longer chunks) and, for a reordered prompt, compares:

* full prefill: vLLM alone (no connector), and vLLM with the connector for a request that opts out
  of reuse (``kv_transfer_params={"blend": false}``);
* CacheBlend: the connector's engine, after one request with the original order stored the
  chunks, reusing them at ``--ratio``.

TTFT is the latency of a one-token request (median of ``--repeats``); the greedy 16-token answers
of vLLM alone and of CacheBlend are compared. Both engines run eagerly with prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-repeat", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--examples", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("LMCACHE_ENABLE_BLENDING", "true")
    os.environ["LMCACHE_BLEND_RECOMPUTE_RATIOS"] = str(args.ratio)

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from lmcache_backend.blend.segmenting import build_blend_prompt
    from lmcache_backend.embedded import embedded_model_path
    from lmcache_backend.examples import builtin_examples, reordered

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    examples = builtin_examples(args.examples, chunks_per_example=args.chunks)

    def prompt(ex, chunks):
        long = [" ".join([c] * args.chunk_repeat) for c in chunks]
        return build_blend_prompt(tok, ex.system, long, ex.question).token_ids

    def engine(connector: bool):
        kv = KVTransferConfig(
            kv_connector="CacheBlendConnector",
            kv_connector_module_path="lmcache_backend.integration.vllm.connector",
            kv_role="kv_both",
        )
        return LLM(
            model=path,
            kv_transfer_config=kv if connector else None,
            enable_prefix_caching=False,
            enforce_eager=True,
            max_model_len=8192,
            seed=0,
        )

    def run(llm, ids, max_tokens, params=None):
        extra = {"kv_transfer_params": params} if params else None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=extra)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        return time.perf_counter() - start, out.outputs[0].text, out.num_cached_tokens

    prompts = [
        (ex, prompt(ex, ex.chunks), prompt(ex, reordered(ex.chunks, seed=1))) for ex in examples
    ]
    # 1. vLLM alone: full prefill of the reordered prompts
    llm = engine(connector=False)
    full_t, full_text = [], []
    for _, _, ids in prompts:
        run(llm, ids, 1)  # warm-up of this shape
        full_t += [run(llm, ids, 1)[0] for _ in range(args.repeats)]
        full_text.append(run(llm, ids, 16)[1])
    llm.llm_engine.engine_core.shutdown()
    del llm
    # 2. with the connector: store the chunks once, then blend the reordered prompt
    llm = engine(connector=True)
    blend_t, optout_t, agree, lengths = [], [], 0, []
    for (ex, first, ids), reference in zip(prompts, full_text):
        run(llm, first, 1)  # fills the store (vLLM prefills it)
        lengths.append(len(ids))
        optout_t += [run(llm, ids, 1, {"blend": False})[0] for _ in range(args.repeats)]
        for _ in range(args.repeats):
            t, _, cached = run(llm, ids, 1)
            assert cached == len(ids) - 1, "the reordered prompt was not claimed"
            blend_t.append(t)
        text = run(llm, ids, 16)[1]
        agree += int(text.strip() == reference.strip())
        print(f"{ex.id}: full {reference!r} | blend {text!r}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    med = statistics.median
    result = {
        "prompt_tokens_mean": statistics.mean(lengths),
        "ttft_full_prefill_vllm_ms": 1000 * med(full_t),
        "ttft_full_prefill_with_connector_opted_out_ms": 1000 * med(optout_t),
        "ttft_blend_ms": 1000 * med(blend_t),
        "speedup_vs_vllm": med(full_t) / med(blend_t),
        "answers_identical_16_tokens": f"{agree}/{len(examples)}",
        "ratio": args.ratio,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
