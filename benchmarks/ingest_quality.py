"""Quality of a pre-encoded corpus: chunks encoded by ``lmcache-backend ingest`` (each computed
alone after the system part) against chunks stored by an earlier request (each computed after the
chunks before it), on the dev set, in one vLLM engine with the CacheBlend connector.

Per example (chunks reordered, the example's own question, as ``docs/quality.md``'s protocol):

* full prefill, opted out (the reference): first-token distribution and a 16-token answer;
* ``request``: the store filled by one earlier request (the chunks in order, another question);
* ``ingest``: the store filled with each chunk's ingest prompt (the prompt ``lmcache-backend
  ingest`` computes: ``--prompt-shape separator``, the example's system prompt);

each then asked with naive reuse (nothing recomputed) and with the default blend (ratio
``--ratio``, the configured selection). The two fillings never see each other's entries: every
example and filling has a ``cache_salt`` of its own (vLLM's prefix cache is off). Reported per
filling and strategy: first-token KL(full || strategy) (mean, median), answers identical to full
prefill's, correct answers, the share of prompt tokens reused; and the paired per-example KL
difference (ingest - request).

    python benchmarks/ingest_quality.py --json out/ingest-quality.json     # 120 examples
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmcache_backend.bench.datasets.dataset import WARM_QUESTION, load_dataset
from lmcache_backend.bench.quality.metrics import answer_correct, answers_agree, kl_divergence
from lmcache_backend.blend.segmenting import build_blend_prompt
from lmcache_backend.data.embedded import resolve_model
from lmcache_backend.data.examples import reordered
from lmcache_backend.settings.arguments import setting_type
from lmcache_backend.settings.writer import STARTED_ENGINE, export

FILLINGS = ("request", "ingest")


def _run(llm, ids, params, salt, vocab: int) -> tuple[torch.Tensor, str]:
    """One greedy 16-token request: its first token's log-probabilities ``[V]`` and text."""
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0, max_tokens=16, logprobs=-1, extra_args={"kv_transfer_params": params}
    )
    out = llm.generate(
        [{"prompt_token_ids": list(ids), "cache_salt": salt}], sampling, use_tqdm=False
    )[0].outputs[0]
    logits = torch.full((vocab,), float("-inf"))
    for token, lp in (out.logprobs[0] if out.logprobs else {}).items():
        if token < vocab:
            logits[token] = lp.logprob
    return logits, out.text.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="first N dev examples (all)")
    parser.add_argument(
        "--ratio",
        type=setting_type("blend_recompute_ratios", "item"),
        default=0.2,
        help="the blend's ratio (0.2)",
    )
    parser.add_argument("--json", help="write every number here")
    parser.add_argument(
        "--eager", action="store_true", help="vLLM without compilation (starts in ~1 min)"
    )
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from lmcache_backend.integration.vllm.offline import offline_engine, read_records

    export(defaults=STARTED_ENGINE, enable_blending=True)
    model = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = load_dataset("dev")[: args.limit]
    stats = Path(tempfile.mkdtemp(prefix="lmcache-ingest-quality-")) / "stats.jsonl"
    llm = offline_engine(
        str(model), stats_file=str(stats), enforce_eager=args.eager, max_logprobs=-1
    )
    vocab = len(tokenizer)

    def build(system, chunks, question):
        return build_blend_prompt(tokenizer, system, chunks, question).token_ids

    strategies = {"naive": {"blend_recompute_ratios": [0.0]}}
    strategies["blend"] = {"blend_recompute_ratios": [args.ratio]}
    rows = []
    started = time.perf_counter()
    for i, ex in enumerate(examples):
        asked = build(ex.system, reordered(ex.chunks, i), ex.question)
        full, full_answer = _run(llm, asked, {"blend": False}, f"full-{i}", vocab)
        row: dict[str, Any] = {"id": ex.id, "tokens": len(asked), "full_answer": full_answer}
        row["full_correct"] = answer_correct(full_answer, ex.answers)
        for filling in FILLINGS:
            salt = f"{filling}-{i}"
            warm = [build(ex.system, ex.chunks, WARM_QUESTION)]
            if filling == "ingest":  # lmcache-backend ingest's prompt for each chunk
                warm = [build(ex.system, [chunk], WARM_QUESTION) for chunk in ex.chunks]
            for ids in warm:
                _run(llm, ids, {"blend": False}, salt, vocab)
            for name, params in strategies.items():
                logits, answer = _run(llm, asked, params, salt, vocab)
                record = read_records(str(stats), left_to_vllm=True)[-1]
                blended = record.get("blended", True) is not False
                reused = record["num_reusable"] - record.get("recomputed_reusable", 0)
                row[f"{filling}/{name}"] = {
                    "blended": blended and not record.get("fallback_reason"),
                    "kl": kl_divergence(full, logits),
                    "first_token_agrees": int(logits.argmax()) == int(full.argmax()),
                    "agrees": answers_agree(answer, full_answer),
                    "correct": answer_correct(answer, ex.answers),
                    "reused_share": reused / len(asked) if blended else 0.0,
                    "answer": answer,
                }
        rows.append(row)
        done = {k: round(v["kl"], 4) for k, v in row.items() if isinstance(v, dict)}
        print(f"{i + 1}/{len(examples)} {ex.id} {json.dumps(done)}", file=sys.stderr, flush=True)
        summary = _summary(rows)
        summary["seconds"] = time.perf_counter() - started
        summary["load"] = os.getloadavg()
        if args.json:  # after every example: an interrupted run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"summary": summary, "examples": rows}, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    out: dict[str, Any] = {"examples": n, "full_correct": sum(r["full_correct"] for r in rows)}
    for key in [k for k in rows[0] if "/" in k]:
        cells = [r[key] for r in rows]
        kls = [c["kl"] for c in cells]
        out[key] = {
            "kl_mean": statistics.fmean(kls),
            "kl_median": statistics.median(kls),
            "answers_as_full": sum(c["agrees"] for c in cells),
            "first_token_as_full": sum(c["first_token_agrees"] for c in cells),
            "correct": sum(c["correct"] for c in cells),
            "reused_share": statistics.fmean(c["reused_share"] for c in cells),
            "blended": sum(c["blended"] for c in cells),
        }
    for name in ("naive", "blend"):
        diff = [r[f"ingest/{name}"]["kl"] - r[f"request/{name}"]["kl"] for r in rows]
        out[f"kl_ingest_minus_request/{name}"] = {
            "mean": statistics.fmean(diff),
            "median": statistics.median(diff),
            "ingest_lower": sum(d < 0 for d in diff),
            "of": n,
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
