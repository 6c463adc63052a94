"""``lmcache-backend verify MODEL``: is CacheBlend exact on this model?

Three checks, each with a pass/fail, on built-in RAG prompts whose chunks are stored in their
original order and then served reordered:

* **re-rotation**: layer-0 keys computed at positions ``p`` and re-rotated to ``p + s`` against
  keys computed at ``p + s`` (relative error). A RoPE scaling the re-rotation mishandles shows
  up here (e.g. YaRN's attention factor applied twice);
* **ratio 1.0**: recomputing every token must give full prefill's answer: maximum logit
  difference of the first token and greedy agreement of the answers;
* **default ratio**: the configured setting reuses the chunks (it blended, nothing fell back);
  its agreement with full prefill is reported, not judged (reuse is approximate by design).

``--engine hf`` compares against the transformers model's own forward pass; ``--engine vllm``
runs vLLM with the connector and compares against the same engine with the request opted out
(``kv_transfer_params={"blend": false}``). The connector runs the adapter checks once at
start-up with ``kv_connector_extra_config={"verify_on_start": true}`` and logs the result.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict
from typing import Any

import torch

from lmcache_backend.blend.exactness import (
    REROTATION_TOLERANCE,
    Check,
    InMemoryStore,
    agreement_checks,
    builtin_prompts,
    checks_passed,
    format_checks,
    rerotation_checks,
    rerotation_error,
    reuse_check,
    tolerance_dtype,
)
from lmcache_backend.models.base import UnsupportedModelError

logger = logging.getLogger(__name__)


# -- HF engine ---------------------------------------------------------------------------------


def verify_hf(model_path: str, dtype: str = "float32", count: int = 4, max_tokens: int = 16):
    """The checks with the transformers model; reference: its own forward pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcache_backend.config import load_config
    from lmcache_backend.integration.hf.engine import HFBlendEngine

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
    config = load_config(enable_blending=True)
    config = config.replace(blend_min_tokens=min(config.blend_min_tokens, 16))
    engine = HFBlendEngine(model, tok, config, store=InMemoryStore())
    prompts = builtin_prompts(tok, count, config.blend_special_str)
    checks = rerotation_checks(engine.adapter, prompts[0][1], engine.ops)
    for label, ratios in (("ratio 1.0", [1.0]), ("default", None)):
        diffs, agree, fallbacks, fractions = [], 0, [], []
        for first, again in prompts:
            engine.warm(first)
            full = engine.full_prefill(again)
            blend = engine.blend_prefill(again, ratios)
            diffs.append(float((blend.logits - full.logits).abs().max()))
            a = engine.decode(again, full, max_tokens).token_ids
            b = engine.decode(again, blend, max_tokens).token_ids
            agree += int(a == b)
            fallbacks.append(blend.blend.fallback_reason)
            fractions.append(blend.blend.recomputed_reusable / max(blend.blend.num_reusable, 1))
        judged = label == "ratio 1.0"
        checks += agreement_checks(model.dtype, label, diffs, agree, len(prompts), judged)
        checks.append(reuse_check(label, fallbacks, fractions))
    return checks


# -- vLLM engine -------------------------------------------------------------------------------


def worker_rerotation_errors(worker: Any = None) -> list[tuple[str, float]]:
    """Run inside a vLLM worker (``LLM.collective_rpc``): the served model's re-rotation error
    of each kind of layer (its description, empty for a model with one kind; the error)."""
    from lmcache_backend.integration.vllm.model_tracker import ENGINE_NAME, ModelTracker
    from lmcache_backend.models.vllm import VLLMModelAdapter

    vllm_config = worker.vllm_config if worker is not None else None
    model = ModelTracker.get_model(ENGINE_NAME)
    adapter = VLLMModelAdapter(model, vllm_config)
    ids = (torch.arange(3, 3 + 96) % 1000 + 100).tolist()
    return [
        (kind, rerotation_error(adapter, ids, layer=layer)) for kind, layer in adapter.layer_kinds()
    ]


def worker_rerotation_error(worker: Any = None) -> float:
    """Run inside a vLLM worker: the largest re-rotation error over the kinds of layer."""
    return max(err for _, err in worker_rerotation_errors(worker))


def verify_vllm(
    model_path: str,
    dtype: str = "float32",
    count: int = 4,
    max_tokens: int = 16,
    llm_kwargs: dict | None = None,
    extra_config: dict | None = None,
) -> tuple[list[Check], dict]:
    """The checks through vLLM with the connector; reference: the same engine with each request
    opted out. Returns the checks and a dict of details (per-prompt records). Call it from a
    script's ``if __name__ == "__main__":`` block (vLLM starts worker processes)."""
    import os
    import tempfile

    from transformers import AutoTokenizer

    from lmcache_backend.config import load_config
    from lmcache_backend.integration.vllm.offline import generate_one, offline_engine, read_records
    from lmcache_backend.settings.writer import STARTED_KV_CACHE_GIB, export

    # vLLM's CPU backend otherwise reserves a share of all memory for its KV cache (and refuses
    # to start when less is free); a check needs little
    export(defaults={"vllm_cpu_kvcache_space": STARTED_KV_CACHE_GIB})
    torch_dtype = getattr(torch, dtype)
    config = load_config(enable_blending=True)
    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = builtin_prompts(tok, count, config.blend_special_str)
    stats = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    extra = {
        "enable_blending": True,
        "blend_min_tokens": min(config.blend_min_tokens, 16),
        # exactness is checked, not speed: ratio 1.0 costs more than a full prefill
        "blend_max_cost": 100.0,
        **(extra_config or {}),
    }
    longest = max(len(p) for pair in prompts for p in pair)
    kwargs = {
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_model_len": max(1024, 1 << math.ceil(math.log2(longest + max_tokens + 1))),
        "seed": 0,
        **(llm_kwargs or {}),
    }
    # The re-rotation check runs a function of this module in the worker (collective_rpc),
    # which vLLM sends pickled only when allowed; this is the verifying process's own engine.
    export(defaults={"vllm_allow_insecure_serialization": True})
    llm = offline_engine(model_path, stats_file=stats, extra_config=extra, dtype=dtype, **kwargs)

    def run(ids, **params):
        before = len(read_records(stats))
        out = generate_one(llm, ids, max_tokens, params or None, logprobs=5)
        new = read_records(stats)[before:]
        return out, (new[-1] if new else None)

    def first_logprobs(out) -> dict[int, float]:
        return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}

    details: dict[str, Any] = {"prompts": []}
    try:
        limit = REROTATION_TOLERANCE[tolerance_dtype(torch_dtype)]
        per_rank = llm.collective_rpc(worker_rerotation_errors)
        checks = []
        for i, (kind, _) in enumerate(per_rank[0]):
            err = max(rank[i][1] for rank in per_rank)
            name = f"re-rotation error ({kind})" if kind else "re-rotation error"
            checks.append(Check(name, f"{err:.2e}", f"{limit:.0e}", bool(err <= limit)))
        stats_rows = {k: {"diffs": [], "agree": 0, "fb": [], "fr": []} for k in ("1", "d")}
        for first, again in prompts:
            run(first)  # vLLM prefills, the connector stores the chunks
            ref, _ = run(again, blend=False)
            row = {"tokens": len(again), "reference": list(ref.outputs[0].token_ids)}
            for key, params in (("1", {"blend_recompute_ratios": [1.0]}), ("d", {})):
                out, record = run(again, **params)
                s = stats_rows[key]
                a, b = first_logprobs(ref), first_logprobs(out)
                shared = set(a) & set(b)
                s["diffs"].append(max((abs(a[t] - b[t]) for t in shared), default=math.inf))
                s["agree"] += int(list(out.outputs[0].token_ids) == row["reference"])
                if record is not None and not record.get("blended", True):
                    reason = record.get("reason", "")
                    record = None  # left to vLLM: nothing was blended
                else:
                    reason = ""
                claimed = record is not None and out.num_cached_tokens == (
                    record["prefix_len"] + record["claimed"]
                )
                s["fb"].append(None if claimed else f"not claimed by the connector {reason}")
                if record is not None:
                    s["fb"][-1] = s["fb"][-1] or record["fallback_reason"]
                s["fr"].append(record["recompute_fraction"] if record else 0.0)
                row[key] = list(out.outputs[0].token_ids)
            details["prompts"].append(row)
        for key, label in (("1", "ratio 1.0"), ("d", "default")):
            s = stats_rows[key]
            judged = key == "1"
            checks += agreement_checks(
                torch_dtype, label, s["diffs"], s["agree"], len(prompts), judged
            )
            checks[-2].name = f"{label}: max first-token log-probability difference (top 5)"
            checks.append(reuse_check(label, s["fb"], s["fr"]))
    finally:
        llm.llm_engine.engine_core.shutdown()
        os.unlink(stats)
    return checks, details


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help="model folder, hub name or embedded model (smollm2, gemma3-270m; default: smollm2)",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: the transformers model in this process (default); vllm: a vLLM engine with "
        "the connector, against the same engine opted out",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the model's dtype (default: float32)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="built-in prompts to blend")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy answer length")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def main(args: argparse.Namespace) -> int:
    from lmcache_backend.data.embedded import resolve_model

    try:
        model = resolve_model(args.model or None)
    except FileNotFoundError as exc:
        print(f"lmcache-backend verify: {exc}", file=sys.stderr)
        return 2
    try:
        if args.engine == "hf":
            checks = verify_hf(model, args.dtype, args.prompts, args.max_tokens)
        else:
            checks, _ = verify_vllm(model, args.dtype, args.prompts, args.max_tokens)
    except UnsupportedModelError as exc:  # one line naming what is not reproduced
        print(f"lmcache-backend verify: {model}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"passed": checks_passed(checks), "checks": [asdict(c) for c in checks]}))
    else:
        print(format_checks(f"CacheBlend on {model} ({args.engine}, {args.dtype})", checks))
    return 0 if checks_passed(checks) else 1
