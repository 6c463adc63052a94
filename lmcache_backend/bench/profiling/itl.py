"""What a running decode stream sees while another prompt is blended, in one vLLM engine.

``python -m lmcache_backend.bench.profiling.itl [--tokens 2000] [--ratio 0.15]`` starts one vLLM
engine with the CacheBlend connector, stores the chunks of a ~``--tokens`` RAG prompt, starts a
decode stream (a short prompt, greedy, ``--stream-tokens`` tokens) and, while it runs, sends the RAG
prompt reordered with a new question: once blended (CacheBlend at ``--ratio``), once as a full
prefill (the request opts out). It prints the stream's inter-token latency: the median while
nothing else runs, and the longest gap from the moment the other prompt is sent to its first
token (every step a sliced blend spans), with both prompts' time to first token.

Blending runs before the step's forward pass, in the step that schedules the claimed prompt, so
the stream's gap in that step is about the blend's time plus one decode step. With
``--layers-per-step n`` (the connector's ``blend_layers_per_step``) the blend is sliced over
steps, ``n`` layer passes each, and the stream decodes between the slices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from lmcache_backend.settings.arguments import setting_type
from lmcache_backend.settings.writer import STARTED_ENGINE, export


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000, help="size of the blended prompt")
    parser.add_argument(
        "--ratio", type=setting_type("blend_recompute_ratios", "item"), default=0.15
    )
    parser.add_argument("--stream-tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument(
        "--layers-per-step",
        default="auto",
        help="blend_layers_per_step: 0 (at once), n (every blend, n passes a step) or auto "
        "(the default: blends longer than one vLLM step are sliced)",
    )
    args = parser.parse_args(argv)
    export(defaults=STARTED_ENGINE)

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from lmcache_backend.bench.datasets.sized import sized_prompts
    from lmcache_backend.config import load_config
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.integration.vllm.offline import generate_one, offline_engine

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    llm = offline_engine(
        path,
        extra_config={"blend_layers_per_step": args.layers_per_step},
        enforce_eager=args.eager,
    )
    engine = llm.llm_engine
    separator = load_config().blend_special_str
    warm, asked = sized_prompts(tok, args.tokens, 2 * args.repeats + 1, separator)
    generate_one(llm, warm, 1, {})  # stores the chunks
    stream_ids = tok.encode("Write a long story about a lighthouse keeper and the sea.")
    counter = iter(range(10**6))

    def sampling(max_tokens: int, params: dict) -> SamplingParams:
        return SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params},
        )

    def one_run(ids, params) -> dict:
        stream, other = f"stream-{next(counter)}", f"other-{next(counter)}"
        engine.add_request(
            stream, {"prompt_token_ids": stream_ids}, sampling(args.stream_tokens, {"blend": False})
        )
        stamps: list[float] = []
        sent_at = first_at = None
        sent_index = done_index = 0  # the stream's tokens when the prompt was sent / answered
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.request_id == stream and out.outputs and out.outputs[0].token_ids:
                    stamps.append(now)
                elif out.request_id == other and first_at is None:
                    first_at = now
            if first_at is not None and not done_index:
                done_index = len(stamps)
            if sent_at is None and len(stamps) == args.stream_tokens // 2:
                engine.add_request(other, {"prompt_token_ids": ids}, sampling(1, params))
                sent_at = time.perf_counter()
                sent_index = len(stamps)
        gaps = [b - a for a, b in zip(stamps[:-1], stamps[1:])]
        # every gap from the send to the prompt's first token (a sliced blend spans many steps)
        during = gaps[max(sent_index - 2, 0) : max(done_index, sent_index) + 2]
        quiet = gaps[5 : sent_index - 2] + gaps[done_index + 3 :]
        return {
            "itl_quiet_ms": 1000 * statistics.median(quiet),
            "itl_max_while_prefilling_ms": 1000 * max(during),
            "other_ttft_ms": 1000 * (first_at - sent_at) if first_at else float("nan"),
        }

    rows = {"CacheBlend": [], "full prefill": []}
    for i in range(args.repeats):
        rows["CacheBlend"].append(
            one_run(asked[2 * i + 1], {"blend_recompute_ratios": [args.ratio]})
        )
        rows["full prefill"].append(one_run(asked[2 * i + 2], {"blend": False}))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{len(asked[1])}-token prompt sent into a running decode stream (load {load}):")
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"  {name:<13} stream ITL {med['itl_quiet_ms']:6.1f} ms quiet, "
            f"{med['itl_max_while_prefilling_ms']:7.1f} ms longest gap; "
            f"prompt TTFT {med['other_ttft_ms']:7.1f} ms"
        )
    engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
