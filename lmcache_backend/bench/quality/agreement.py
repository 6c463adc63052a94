"""Does ratio 1.0 reproduce vLLM's own prefill? Greedy answers of one engine, blended vs opted out.

``python -m lmcache_backend.bench.quality.agreement [--model PATH] [--dtype bfloat16 float32]
[--dataset dev] [--prompts 16] [--max-tokens 24] [--ratio 1.0]`` serves RAG prompts (the dev set's
first ``--prompts`` by default, ``--dataset builtin`` for the built-in ones) through vLLM with the
CacheBlend connector: each example's chunks once in their original order with another question
(vLLM prefills it, the connector stores the chunks), then reordered with the example's own question
twice: opted out of reuse (``kv_transfer_params={"blend": false}``: vLLM's own prefill, the
reference) and blended at ``--ratio``. It prints, per dtype, how many greedy answers are
identical and where the others first differ. Prefix caching is off, so every reference token
is vLLM's computation.

``--against-prefix-cache`` measures how closely vLLM equals itself instead: prefix caching on, every
request opted out, each reordered prompt served twice; the second run reads vLLM's own cached
blocks and computes only the tokens past the last full block, as a blended request leaves vLLM
its question. The blended answers can be no closer to a cold prefill than that.
"""

from __future__ import annotations

import argparse
import json

from lmcache_backend.settings.arguments import setting_type
from lmcache_backend.settings.writer import STARTED_KV_CACHE_GIB, export


def _run_dtype(model: str, dtype: str, args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from lmcache_backend.bench.datasets.dataset import load_dataset, prompt_pair
    from lmcache_backend.blend.segmenting import build_blend_prompt, separator_pattern
    from lmcache_backend.integration.vllm.offline import generate_one, offline_engine

    tok = AutoTokenizer.from_pretrained(model)
    tail = separator_pattern(tok, " # # ").query_start

    def build(system, chunks, question):
        return build_blend_prompt(tok, system, chunks, question).token_ids

    dataset = None if args.dataset == "builtin" else args.dataset
    examples = load_dataset(dataset, count=args.prompts)[: args.prompts]
    prompts = []
    for ex in examples:
        pair = prompt_pair(build, ex, seed=1)
        prompts.append((ex.id, pair.warm_ids, pair.asked_ids))
    llm = offline_engine(
        model,
        extra_config={"enable_blending": True, "blend_min_tokens": 32},
        enable_prefix_caching=args.against_prefix_cache,
        max_model_len=4096,
        dtype=dtype,
    )

    def run(ids, max_tokens, **params):
        out = generate_one(llm, ids, max_tokens, params or None)
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    rows = []
    try:
        for pid, first, again in prompts:
            if args.against_prefix_cache:
                ref, _ = run(again, args.max_tokens, blend=False)
                got, cached = run(again, args.max_tokens, blend=False)
            else:
                run(first, 1)
                ref, _ = run(again, args.max_tokens, blend=False)
                got, cached = run(again, args.max_tokens, blend_recompute_ratios=[args.ratio])
            diverge = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            if diverge is None and len(ref) != len(got):
                diverge = min(len(ref), len(got))
            rows.append(
                {
                    "id": pid,
                    "tokens": len(again),
                    # the connector provides every token before the question
                    "claimed": cached == tail(again) > 0,
                    "cached_tokens": cached,
                    "identical": diverge is None,
                    "first_difference": diverge,
                }
            )
            print(json.dumps({"dtype": dtype, **rows[-1]}), flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    agree = sum(r["identical"] for r in rows)
    return {
        "dtype": dtype,
        "reference": "prefix-cache hit vs cold" if args.against_prefix_cache else "opted out",
        "ratio": None if args.against_prefix_cache else args.ratio,
        "identical": f"{agree}/{len(rows)}",
        "claimed": f"{sum(r['claimed'] for r in rows)}/{len(rows)}",
        "max_tokens": args.max_tokens,
        "prompt_tokens_mean": sum(r["tokens"] for r in rows) / max(len(rows), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--dataset", default="dev", help="dev (default), builtin or a JSONL file")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--ratio", type=setting_type("blend_recompute_ratios", "item"), default=1.0)
    parser.add_argument(
        "--against-prefix-cache",
        action="store_true",
        help="vLLM against itself: a prefix-cache hit vs a cold prefill (no blending)",
    )
    args = parser.parse_args()
    export(defaults={"vllm_cpu_kvcache_space": STARTED_KV_CACHE_GIB})
    model = args.model
    if model is None:
        from lmcache_backend.data.embedded import embedded_model_path

        model = str(embedded_model_path())
    results = [_run_dtype(model, dtype, args) for dtype in args.dtype]
    print("SUMMARY " + json.dumps(results))


if __name__ == "__main__":
    main()
