"""Time to first token of CacheBlend vs vLLM's full prefill, in one vLLM engine.

``python -m lmcache_backend.bench.profiling.measure [--chunks 4] [--chunk-repeat 3] [--ratio
0.15] [--examples 4]`` builds RAG prompts from the built-in examples (each chunk repeated
``--chunk-repeat`` times to make longer chunks) and, for the prompt with its chunks reordered and a
new question in every request, compares:

* full prefill on the same engine: the connector's engine, for a request that opts out of reuse
  (``kv_transfer_params={"blend": false}``): the baseline the speed-up is quoted against;
* CacheBlend: the same engine, after one request with the original order and another question
  stored the chunks, reusing them at ``--ratio``;
* full prefill by vLLM alone (no connector), bound to the same cores.

vLLM's CPU worker binds its OpenMP threads to all allowed cores but the ones it reserves for its
other processes, and it reserves one more core per worker when a KV connector is configured; on a
2-core machine a plain engine computes on one core and the connector's engine on two. Both engines
here are given the same cores through ``VLLM_CPU_OMP_THREADS_BIND`` (``--cores``, default: every
core this process may use), so "vLLM alone" is comparable.

TTFT is the latency of a one-token request (median of ``--repeats`` per example, requests of the
different kinds interleaved); the greedy 16-token answers of vLLM alone and of CacheBlend are
compared. Both engines run eagerly with prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from lmcache_backend.settings import read_variable
from lmcache_backend.settings.arguments import setting_type
from lmcache_backend.settings.writer import STARTED_ENGINE, export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-repeat", type=int, default=3)
    parser.add_argument(
        "--ratio", type=setting_type("blend_recompute_ratios", "item"), default=0.15
    )
    parser.add_argument("--examples", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cores",
        default=None,
        help="cores of both engines' workers, e.g. 0-1 (VLLM_CPU_OMP_THREADS_BIND; default: "
        "every core this process may use)",
    )
    args = parser.parse_args()
    cores = args.cores or read_variable("VLLM_CPU_OMP_THREADS_BIND")
    if not cores:
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    export(
        defaults=STARTED_ENGINE,
        vllm_cpu_omp_threads_bind=cores,
        blend_recompute_ratios=[args.ratio],
    )

    from transformers import AutoTokenizer

    from lmcache_backend.blend.segmenting import build_blend_prompt
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.data.examples import builtin_examples, reordered
    from lmcache_backend.integration.vllm.offline import generate_one, offline_engine

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    examples = builtin_examples(args.examples, chunks_per_example=args.chunks)

    def prompt(ex, chunks, question):
        long = [" ".join([c] * args.chunk_repeat) for c in chunks]
        return build_blend_prompt(tok, ex.system, long, question).token_ids

    def engine(connector: bool):
        return offline_engine(path, connector=connector)

    def run(llm, ids, max_tokens, params=None):
        start = time.perf_counter()
        out = generate_one(llm, ids, max_tokens, params or None)
        return time.perf_counter() - start, out.outputs[0].text, out.num_cached_tokens

    cases = []
    for ex in examples:
        order = reordered(ex.chunks, seed=1)
        cases.append(
            {
                "example": ex,
                # the store is filled with the chunks and a question never asked again
                "warm": prompt(ex, ex.chunks, "Which of these people was born first?"),
                "answer": prompt(ex, order, ex.question),
                # a new question in every timed request, as in real use: its tail is never cached
                "timed": [
                    prompt(ex, order, f"{ex.question} (request {i})")
                    for i in range(3 * args.repeats + 1)
                ],
            }
        )
    # 1. vLLM alone (same cores): full prefill of the reordered prompts
    llm = engine(connector=False)
    full_t, full_text = [], []
    for case in cases:
        timed = case["timed"]
        run(llm, timed[0], 1)  # warm-up of this shape
        full_t += [run(llm, ids, 1)[0] for ids in timed[1 : args.repeats + 1]]
        full_text.append(run(llm, case["answer"], 16)[1])
    llm.llm_engine.engine_core.shutdown()
    del llm
    # 2. with the connector: store the chunks once, then full prefill (opted out) and CacheBlend,
    #    interleaved, each request with a new question
    llm = engine(connector=True)
    blend_t, optout_t, agree, lengths = [], [], 0, []
    for case, reference in zip(cases, full_text):
        ex, timed = case["example"], case["timed"]
        run(llm, case["warm"], 1)  # fills the store (vLLM prefills it)
        lengths.append(len(case["answer"]))
        run(llm, timed[0], 1)  # warm-up of this shape
        for i in range(args.repeats):
            optout_t.append(run(llm, timed[2 * i + 1], 1, {"blend": False})[0])
            ids = timed[2 * i + 2]
            t, _, cached = run(llm, ids, 1)
            assert cached == len(ids) - 1, "the reordered prompt was not claimed"
            blend_t.append(t)
        text = run(llm, case["answer"], 16)[1]
        agree += int(text.strip() == reference.strip())
        print(f"{ex.id}: full {reference!r} | blend {text!r}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    med = statistics.median
    result = {
        "prompt_tokens_mean": statistics.mean(lengths),
        "cores": cores,
        "ttft_full_prefill_same_engine_ms": 1000 * med(optout_t),
        "ttft_blend_ms": 1000 * med(blend_t),
        "blend_vs_full_prefill_same_engine": med(blend_t) / med(optout_t),
        "ttft_full_prefill_vllm_alone_same_cores_ms": 1000 * med(full_t),
        "answers_identical_16_tokens": f"{agree}/{len(examples)}",
        "ratio": args.ratio,
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
