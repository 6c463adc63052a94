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
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lmcache_backend.store import SegmentKV, SegmentStore

logger = logging.getLogger(__name__)

#: Relative error of re-rotated keys allowed per model dtype (the keys are rounded to it).
REROTATION_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
#: Largest first-token logit difference at ratio 1.0 per model dtype (fp32: the same arithmetic
#: in another order; bf16: one rounding of 8 mantissa bits per op, over 30 layers).
LOGIT_TOLERANCE = {torch.float32: 1e-2, torch.float16: 0.5, torch.bfloat16: 1.0}
#: Answers allowed to differ from full prefill at ratio 1.0, per dtype (of the prompts run):
#: fp32 none; half precision one, as two orders of the same rounded sums can flip a near-tie.
DISAGREEMENT_ALLOWED = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 1}


@dataclass
class Check:
    """One check: ``passed`` is None for a reported-only number."""

    name: str
    value: str
    limit: str
    passed: bool | None

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "info"}[self.passed]
        limit = f" (limit {self.limit})" if self.limit else ""
        return f"{verdict:4}  {self.name}: {self.value}{limit}"


def checks_passed(checks: Sequence[Check]) -> bool:
    return all(c.passed is not False for c in checks)


def format_checks(title: str, checks: Sequence[Check]) -> str:
    verdict = "passed" if checks_passed(checks) else "FAILED"
    return "\n".join([f"{title}: {verdict}", *("  " + c.line() for c in checks)])


class _DictStore(SegmentStore):
    """A private in-memory store, so a check never touches the engine's segments."""

    def __init__(self) -> None:
        self._d: dict[str, SegmentKV] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> SegmentKV | None:
        return self._d.get(key)

    def put(self, key: str, kv: SegmentKV) -> bool:
        with self._lock:
            self._d.setdefault(key, kv)
        return True

    def contains(self, key: str) -> bool:
        return key in self._d

    def clear(self) -> None:
        self._d.clear()

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self._d.values())


def _dtype_key(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in REROTATION_TOLERANCE else torch.bfloat16


def builtin_prompts(tokenizer: Any, count: int = 4, separator: str | None = None) -> list:
    """``count`` pairs ``(original, reordered)`` of prompt token ids from the built-in examples."""
    from lmcache_backend.blend.segmenting import build_blend_prompt
    from lmcache_backend.examples import builtin_examples, reordered

    # separator-free mode (""): the default separator only shapes the text, blocks are found in it
    kw = {"blend_special_str": separator} if separator else {}
    pairs = []
    for ex in builtin_examples(count, chunks_per_example=3):
        first = build_blend_prompt(tokenizer, ex.system, ex.chunks, ex.question, **kw)
        again = build_blend_prompt(
            tokenizer, ex.system, reordered(ex.chunks, seed=1), ex.question, **kw
        )
        pairs.append((first.token_ids, again.token_ids))
    return pairs


@torch.inference_mode()
def rerotation_error(adapter: Any, token_ids: Sequence[int], shift: int = 97, ops=None) -> float:
    """Relative error of layer-0 keys of ``token_ids`` re-rotated from positions ``0..n-1`` to
    ``shift..shift+n-1`` against the keys the adapter computes there."""
    from lmcache_backend.ops import get_ops

    ops = ops or get_ops("torch")
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    x = adapter.attention_input(0, adapter.embed(ids))
    old = torch.arange(ids.numel(), device=adapter.device)
    new = old + shift
    _, k_old, _ = adapter.qkv(0, x, old)
    _, k_new, _ = adapter.qkv(0, x, new)
    moved = k_old.clone()
    ops.rope_rerotate_k(moved, old, new, adapter.cos_sin_cache, adapter.is_neox)
    diff = (moved.double() - k_new.double()).norm()
    return float(diff / k_new.double().norm().clamp_min(1e-30))


def rerotation_check(adapter: Any, token_ids: Sequence[int], ops=None) -> Check:
    err = rerotation_error(adapter, token_ids, ops=ops)
    limit = REROTATION_TOLERANCE[_dtype_key(adapter.dtype)]
    return Check("re-rotation error", f"{err:.2e}", f"{limit:.0e}", bool(err <= limit))


def _agreement_checks(
    dtype: torch.dtype,
    label: str,
    logit_diffs: list[float],
    agree: int,
    total: int,
    judged: bool,
) -> list[Check]:
    key = _dtype_key(dtype)
    max_diff = max(logit_diffs) if logit_diffs else float("nan")
    logit_limit = LOGIT_TOLERANCE[key]
    allowed = DISAGREEMENT_ALLOWED[key]
    return [
        Check(
            f"{label}: max first-token logit difference",
            f"{max_diff:.3g}",
            f"{logit_limit:g}" if judged else "",
            bool(max_diff <= logit_limit) if judged else None,
        ),
        Check(
            f"{label}: greedy answers equal to full prefill",
            f"{agree}/{total}",
            f">= {total - allowed}/{total}" if judged else "",
            bool(agree >= total - allowed) if judged else None,
        ),
    ]


def _reuse_check(label: str, fallbacks: list[str | None], fractions: list[float]) -> Check:
    fell = [f for f in fallbacks if f]
    mean = sum(fractions) / max(len(fractions), 1)
    value = f"{len(fallbacks) - len(fell)}/{len(fallbacks)} blended, {mean:.0%} recomputed"
    return Check(f"{label}: chunks reused", value, "all blended", not fell)


@torch.inference_mode()
def adapter_checks(
    adapter: Any,
    separator: Sequence[int],
    prompts: Sequence[tuple[Sequence[int], Sequence[int]]],
    config: Any,
    *,
    reference: Callable[[Sequence[int]], torch.Tensor] | None = None,
    ops=None,
) -> list[Check]:
    """The checks on a model adapter alone (the connector's start-up check).

    Args:
        adapter: a :class:`~lmcache_backend.models.base.ModelAdapter`.
        separator: the separator's token ids.
        prompts: ``(original, reordered)`` token-id pairs.
        config: a :class:`~lmcache_backend.config.BlendConfig` (its ratios are the default).
        reference: last-token ``[vocab]`` logits of a full prefill; default: the blender's own
            full prefill (every token computed, nothing reused).
        ops: op set (default: the configured backend's).

    Only the first token is compared here (greedy agreement of the first token).
    """
    from lmcache_backend.blend import LMCBlender, SegmentCache
    from lmcache_backend.ops import get_ops

    ops = ops or get_ops(config.backend)
    store = _DictStore()
    cfg = config.replace(blend_min_tokens=min(config.blend_min_tokens, 16))
    full_cfg = cfg.replace(blend_recompute_ratios=[1.0])
    blender = LMCBlender(store, None, cfg, adapter, separator, ops)
    full_blender = LMCBlender(store, None, full_cfg, adapter, separator, ops)
    segments = SegmentCache(store, adapter.fingerprint, separator)
    checks = [rerotation_check(adapter, prompts[0][1], ops)]
    stats = {
        k: {"diffs": [], "agree": 0, "fallbacks": [], "fractions": []}
        for k in ("ratio 1.0", "default")
    }
    for first, again in prompts:
        warm = blender.blend(list(first), torch.zeros(len(first), dtype=torch.bool))
        segments.store_segments(list(first), warm.keys, warm.values)
        if reference is None:
            ref = blender.blend(list(again), torch.zeros(len(again), dtype=torch.bool)).logits
        else:
            ref = reference(again)
        for label, b in (("ratio 1.0", full_blender), ("default", blender)):
            res = b.blend(list(again))
            s = stats[label]
            s["diffs"].append(float((res.logits.float() - ref.float()).abs().max()))
            s["agree"] += int(int(res.logits.argmax()) == int(ref.argmax()))
            s["fallbacks"].append(res.fallback_reason)
            s["fractions"].append(res.recomputed_reusable / max(res.num_reusable, 1))
    for label, s in stats.items():
        judged = label == "ratio 1.0"
        checks += _agreement_checks(
            adapter.dtype, label, s["diffs"], s["agree"], len(prompts), judged
        )
        checks[-1].name = f"{label}: first tokens equal to full prefill"
        checks.append(_reuse_check(label, s["fallbacks"], s["fractions"]))
    return checks


# -- HF engine ---------------------------------------------------------------------------------


def verify_hf(model_path: str, dtype: str = "float32", count: int = 4, max_tokens: int = 16):
    """The checks with the transformers model; reference: its own forward pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcache_backend.config import load_config
    from lmcache_backend.hf_engine import HFBlendEngine

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
    config = load_config(enable_blending=True)
    config = config.replace(blend_min_tokens=min(config.blend_min_tokens, 16))
    engine = HFBlendEngine(model, tok, config, store=_DictStore())
    prompts = builtin_prompts(tok, count, config.blend_special_str)
    checks = [rerotation_check(engine.adapter, prompts[0][1], engine.ops)]
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
        checks += _agreement_checks(model.dtype, label, diffs, agree, len(prompts), judged)
        checks.append(_reuse_check(label, fallbacks, fractions))
    return checks


# -- vLLM engine -------------------------------------------------------------------------------


def worker_rerotation_error(worker: Any = None) -> float:
    """Run inside a vLLM worker (``LLM.collective_rpc``): re-rotation error of the served model."""
    from lmcache_backend.model_tracker import ENGINE_NAME, ModelTracker
    from lmcache_backend.models.vllm import VLLMModelAdapter

    vllm_config = worker.vllm_config if worker is not None else None
    model = ModelTracker.get_model(ENGINE_NAME)
    adapter = VLLMModelAdapter(model, vllm_config)
    ids = torch.arange(3, 3 + 96) % 1000 + 100
    return rerotation_error(adapter, ids.tolist())


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
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from lmcache_backend.config import load_config
    from lmcache_backend.integration.vllm import kv_transfer_config

    # vLLM's CPU backend otherwise reserves a share of all memory for its KV cache (and refuses
    # to start when less is free); a check needs little
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch_dtype = getattr(torch, dtype)
    config = load_config(enable_blending=True)
    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = builtin_prompts(tok, count, config.blend_special_str)
    stats = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    extra = {
        "enable_blending": True,
        "blend_min_tokens": min(config.blend_min_tokens, 16),
        "stats_file": stats,
        **(extra_config or {}),
    }
    kv = KVTransferConfig(**kv_transfer_config(**extra))
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
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = LLM(model=model_path, dtype=dtype, kv_transfer_config=kv, **kwargs)

    def records() -> list[dict]:
        if not os.path.exists(stats):
            return []
        with open(stats, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def run(ids, **params):
        extra_args = {"kv_transfer_params": params} if params else None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, extra_args=extra_args)
        before = len(records())
        out = llm.generate([{"prompt_token_ids": list(ids)}], sp, use_tqdm=False)[0]
        new = records()[before:]
        return out, (new[-1] if new else None)

    def first_logprobs(out) -> dict[int, float]:
        return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}

    details: dict[str, Any] = {"prompts": []}
    try:
        err = max(llm.collective_rpc(worker_rerotation_error))
        limit = REROTATION_TOLERANCE[_dtype_key(torch_dtype)]
        checks = [Check("re-rotation error", f"{err:.2e}", f"{limit:.0e}", bool(err <= limit))]
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
                claimed = record is not None and out.num_cached_tokens == (
                    record["prefix_len"] + record["claimed"]
                )
                s["fb"].append(None if claimed else "not claimed by the connector")
                if record is not None:
                    s["fb"][-1] = s["fb"][-1] or record["fallback_reason"]
                s["fr"].append(record["recompute_fraction"] if record else 0.0)
                row[key] = list(out.outputs[0].token_ids)
            details["prompts"].append(row)
        for key, label in (("1", "ratio 1.0"), ("d", "default")):
            s = stats_rows[key]
            judged = key == "1"
            checks += _agreement_checks(
                torch_dtype, label, s["diffs"], s["agree"], len(prompts), judged
            )
            checks[-2].name = f"{label}: max first-token log-probability difference (top 5)"
            checks.append(_reuse_check(label, s["fb"], s["fr"]))
    finally:
        llm.llm_engine.engine_core.shutdown()
        os.unlink(stats)
    return checks, details


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", help="model folder or hub name (default: the embedded model)"
    )
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--prompts", type=int, default=4, help="built-in prompts to blend")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy answer length")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def main(args: argparse.Namespace) -> int:
    model = args.model
    if not model:
        from lmcache_backend.embedded import embedded_model_path

        model = str(embedded_model_path())
    if args.engine == "hf":
        checks = verify_hf(model, args.dtype, args.prompts, args.max_tokens)
    else:
        checks, _ = verify_vllm(model, args.dtype, args.prompts, args.max_tokens)
    if args.json:
        print(json.dumps({"passed": checks_passed(checks), "checks": [asdict(c) for c in checks]}))
    else:
        print(format_checks(f"CacheBlend on {model} ({args.engine}, {args.dtype})", checks))
    return 0 if checks_passed(checks) else 1
