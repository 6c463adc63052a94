"""Child of the vLLM step: vLLM's own engine (``vllm.LLM``, one process) with the connector,
run from the unpacked bundle (``hardware/vllm_bundle.py`` sets ``PYTHONPATH``).

Parts, each recorded as one result (a failure as the part's name and one line naming the missing
piece, never a traceback):

1. **smoke, stock connector**: a tiny Llama served with vLLM's own ``ExampleConnector``, one
   request: vLLM's engine runs on this path at all;
2. **smoke, CacheBlend**: the model of ``--shape`` served with ``CacheBlendConnector`` configured
   as users do (``kv_transfer_config``, ``LMCACHE_ENABLE_BLENDING=true``), one request;
3. **agreement**: a RAG prompt stored, then reordered with a new question, sent as full prefill
   (``{"blend": false}``) and blended at ratio 1.0 (every token recomputed) and at the default
   ratio; the last token's logits (vLLM's ``logprobs_mode="raw_logits"``, the whole vocabulary)
   compared: relative error, KL, top-1;
4. **time**: per size, the chunks stored, one untimed round, then ``--repeats`` rounds of full
   prefill and blend (a new order and question each, interleaved); TTFT from vLLM's own request
   metrics (``RequestOutput.metrics.first_token_latency``), peak device memory per request.

The weights are vLLM's dummy ones drawn again (seeded normal, std 0.02, norms 1: the init
``--steps blend``'s model gets from transformers), since vLLM's dummy init (uniform +-1e-3) gives
near-flat logits where every comparison agrees.

``python -m lmcache_backend.hardware.vllm_engine --shape llama-3.1-8b --sizes 2000,8000,32000
--repeats 3 --json FILE``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from lmcache_backend.hardware import vllm_model
from lmcache_backend.settings.writer import Variables, export

#: variables that select vLLM's native/Triton code on this path (see docs/hardware.md)
ENGINE_VARIABLES: Variables = {
    "vllm_use_v2_model_runner": False,  # V2 needs the extension's get_cuda_view_from_cpu_tensor
    "vllm_use_flashinfer_sampler": False,
    "vllm_enable_v1_multiprocessing": False,  # one process: the engine core runs in this one
    # the GPU machine has no network: no usage report
    "vllm_no_usage_stats": True,
}
#: the connector's settings, as users set them: blending on, and room on the host for a 32k
#: prompt's chunks (4 GiB of bf16 K/V at this shape) next to the shorter prompts'
USER_VARIABLES: Variables = {"enable_blending": True, "max_local_cpu_size": 16.0}
#: RAG prompt shape of ``--steps blend`` (benchmarks/device_blend_setup.py): tokens
CHUNK, SYSTEM, QUESTION = 512, 64, 32
#: the weights' spread (transformers' initializer_range for Llama)
WEIGHT_STD = 0.02
#: how far ratio 1.0's last-token logits may be from full prefill's (relative error), by dtype:
#: in bf16 its own rounding at this depth (``--steps blend`` measured 4.2e-2 between the bf16
#: blend and the bf16 prefill at 8B, 9.1e-2 between the bf16 and fp32 prefills); in fp32 the
#: two computations are the same up to summation order (the CPU rehearsal: 2.2e-7)
AGREEMENT_LIMIT = {"bfloat16": 0.1, "float16": 0.1, "float32": 1e-4}


def engine_kwargs(
    folder: Path, max_len: int, smoke: bool = False, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """``vllm.LLM`` arguments: the native/Triton path, dummy weights, one-step prefill."""
    kwargs: dict[str, Any] = {
        "model": str(folder),
        "load_format": "dummy",
        "dtype": dtype,
        "enforce_eager": True,
        "attention_backend": "TRITON_ATTN",
        "compilation_config": {"custom_ops": ["none"]},
        "kernel_config": {
            "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
        },
        "enable_prefix_caching": False,
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,
        "max_num_seqs": 4,
        "seed": 0,
        "disable_log_stats": False,
    }
    if smoke:
        # a small KV-cache pool, so that the next engine in this process finds the device free
        kwargs["kv_cache_memory_bytes"] = 256 << 20
    else:
        kwargs.update(logprobs_mode="raw_logits", max_logprobs=-1, gpu_memory_utilization=0.85)
    return kwargs


#: the bundle's stand-ins: a failure is placed at vLLM's line that called them
_STAND_INS = ("_C_stable_libtorch.py", "_vllm_fa2_C.py")


def failure(part: str, exc: BaseException) -> dict:
    """One line naming the missing piece: the exception, its message and the last line of vLLM's
    own code it passed through."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = next(
        (
            f
            for f in reversed(frames)
            if "/vllm/" in f.filename and not f.filename.endswith(_STAND_INS)
        ),
        frames[-1] if frames else None,
    )
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    return {"part": part, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400] + at}


class Prompts:
    """RAG prompts of random token ids: a system part, chunks, a question, separated by the
    separator's ids (the tokenizer's ``#`` twice)."""

    def __init__(self, vocab: int, separator: list[int], seed: int = 0, chunk: int = CHUNK) -> None:
        self.rng = random.Random(seed)
        self.vocab, self.separator, self.chunk = vocab, separator, chunk

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(vllm_model.FIRST_FREE_ID, self.vocab) for _ in range(n)]

    def rag(self, size: int, rounds: int) -> tuple[list[int], list[list[int]]]:
        """The warm prompt (chunks in order) and ``rounds`` reordered ones with new questions."""
        n = max(2, (size - SYSTEM - QUESTION) // (self.chunk + len(self.separator)))
        system, chunks = self.ids(SYSTEM), [self.ids(self.chunk) for _ in range(n)]

        def prompt(order: list[int]) -> list[int]:
            out = list(system)
            for i in order:
                out += self.separator + chunks[i]
            return out + self.separator + self.ids(QUESTION)

        asked = []
        for _ in range(rounds):
            order = list(range(n))
            self.rng.shuffle(order)
            if order == sorted(order):  # the stored order would reuse every chunk in place
                order.reverse()
            asked.append(prompt(order))
        return prompt(list(range(n))), asked


def redraw_weights(worker: Any, seed: int = 0, std: float = WEIGHT_STD) -> int:
    """In the worker: every weight drawn again from N(0, std), norms set to 1; the count."""
    import torch

    model = worker.model_runner.model
    gens: dict[torch.device, torch.Generator] = {}
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # drawn where the weight lives: 8B values drawn on a CPU would take minutes
                gen = gens.setdefault(
                    param.device, torch.Generator(device=param.device).manual_seed(seed)
                )
                param.normal_(0.0, std, generator=gen)
            count += 1
    return count


def _accelerator():
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def ask(llm: Any, ids: list[int], params: dict | None, logits: bool = False) -> dict:
    """One greedy one-token request; its TTFT (vLLM's metrics), peak memory, logits."""
    from vllm import SamplingParams

    acc = _accelerator()
    if acc is not None:
        acc.synchronize()
        acc.reset_peak_memory_stats()
    resting = acc.memory_allocated() if acc is not None else 0
    sampling = SamplingParams(
        temperature=0,
        max_tokens=1,
        logprobs=-1 if logits else None,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    peak = acc.max_memory_allocated() if acc is not None else 0
    metrics = getattr(out, "metrics", None)
    got = {
        "ttft": getattr(metrics, "first_token_latency", None) or wall,
        "ttft_from": "vllm" if getattr(metrics, "first_token_latency", None) else "wall",
        "wall": wall,
        "peak": peak,
        "extra": peak - resting,
        "token": out.outputs[0].token_ids[0],
    }
    if logits:
        first = out.outputs[0].logprobs[0]
        got["logits"] = [first[t].logprob for t in sorted(first)]
    return got


def compare(full: list[float], blended: list[float]) -> dict:
    """Relative error, KL(full || blended) and top-1 of two logit vectors."""
    import torch

    f, b = torch.tensor(full, dtype=torch.float64), torch.tensor(blended, dtype=torch.float64)
    kl = torch.sum(torch.softmax(f, 0) * (torch.log_softmax(f, 0) - torch.log_softmax(b, 0)))
    return {
        "rel_err": float(torch.linalg.vector_norm(b - f) / torch.linalg.vector_norm(f)),
        "kl": float(kl),
        "top1_agrees": int(f.argmax()) == int(b.argmax()),
        "vocab": len(full),
    }


def smoke_stock(work: Path) -> dict:
    """A tiny Llama with vLLM's own ExampleConnector, one request."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    folder = vllm_model.write_folder(work / "tiny", "tiny", 1024)
    start = time.perf_counter()
    kv = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(work / "example-connector")},
    )
    llm = LLM(kv_transfer_config=kv, **engine_kwargs(folder, 1024, smoke=True))
    up = time.perf_counter() - start
    got = ask(llm, Prompts(vllm_model.TINY["vocab_size"], vllm_model.SEPARATOR_IDS).ids(200), None)
    llm.llm_engine.engine_core.shutdown()
    del llm
    _release_device()
    return {"part": "smoke: ExampleConnector", "ok": True, "start_s": up, **_short(got)}


def _release_device() -> None:
    """Give the device's memory back before the next engine measures what is free."""
    import gc

    gc.collect()
    acc = _accelerator()
    if acc is not None:
        acc.empty_cache()


def _short(got: dict) -> dict:
    return {k: v for k, v in got.items() if k != "logits"}


def _record(stats: str, before: int) -> dict | None:
    from lmcache_backend.integration.vllm.offline import read_records

    new = read_records(stats, left_to_vllm=True)[before:]
    return new[-1] if new else None


def _count(stats: str) -> int:
    from lmcache_backend.integration.vllm.offline import read_records

    return len(read_records(stats, left_to_vllm=True))


def run(
    shape: str,
    sizes: list[int],
    repeats: int,
    work: Path,
    chunk: int = CHUNK,
    dtype: str = "bfloat16",
) -> list[dict]:
    """Every part in order; a failing part is recorded and the ones that need its engine are
    skipped (their results say so)."""
    export(defaults=USER_VARIABLES, **ENGINE_VARIABLES)
    os.environ["HF_HUB_OFFLINE"] = "1"  # no hub look-ups: the model folders are local
    results: list[dict] = []
    try:
        results.append(smoke_stock(work))
    except Exception as exc:  # noqa: BLE001 - recorded as the part's row
        results.append(failure("smoke: ExampleConnector", exc))
    _release_device()

    from vllm import LLM
    from vllm.config import KVTransferConfig

    from lmcache_backend.integration.vllm import kv_transfer_config

    vocab = vllm_model.SHAPES[shape]["vocab_size"]
    prompts = Prompts(vocab, vllm_model.SEPARATOR_IDS, seed=1, chunk=chunk)
    rag = {size: prompts.rag(size, repeats + 2) for size in sizes}
    longest = max(len(p) for warm, asked in rag.values() for p in [warm, *asked])
    max_len = vllm_model.context_length(longest)
    folder = vllm_model.write_folder(work / shape, shape, max_len)
    stats = str(work / "stats.jsonl")
    part = "smoke: CacheBlendConnector"
    try:
        start = time.perf_counter()
        kv = KVTransferConfig(**kv_transfer_config(stats))
        llm = LLM(kv_transfer_config=kv, **engine_kwargs(folder, max_len, dtype=dtype))
        up = time.perf_counter() - start
        redrawn = llm.collective_rpc(redraw_weights)[0]
        got = ask(llm, prompts.ids(200), None)
        results.append({"part": part, "ok": True, "start_s": up, "weights": redrawn, **_short(got)})
    except Exception as exc:  # noqa: BLE001
        results.append(failure(part, exc))
        return results
    try:
        results.append(agreement(llm, rag[sizes[min(1, len(sizes) - 1)]], stats, dtype))
    except Exception as exc:  # noqa: BLE001
        results.append(failure("agreement", exc))
    for size in sizes:
        try:
            results.append(timing(llm, size, rag[size], repeats, stats))
        except Exception as exc:  # noqa: BLE001
            results.append(failure(f"time: {size:,} tokens", exc))
    llm.llm_engine.engine_core.shutdown()
    return results


def agreement(
    llm: Any, rag: tuple[list[int], list[list[int]]], stats: str, dtype: str = "bfloat16"
) -> dict:
    """Ratio 1.0 and the default ratio against the same engine's full prefill."""
    warm, asked = rag
    ask(llm, warm, {"blend": False})  # prefills and stores the chunks
    ids = asked[0]
    full = ask(llm, ids, {"blend": False}, logits=True)
    limit = AGREEMENT_LIMIT[dtype]
    out: dict[str, Any] = {"part": "agreement", "ok": True, "tokens": len(ids), "dtype": dtype}
    out["limit"] = limit
    for label, params in (("ratio 1.0", {"blend_recompute_ratios": [1.0]}), ("default", {})):
        before = _count(stats)
        blended = ask(llm, ids, params, logits=True)
        record = _record(stats, before) or {}
        out[label] = {
            **compare(full["logits"], blended["logits"]),
            "blended": bool(record.get("blended", True)) and not record.get("fallback_reason"),
            "why_not": record.get("reason") or record.get("fallback_reason"),
            "recompute_fraction": record.get("recompute_fraction"),
        }
    one = out["ratio 1.0"]
    out["ok"] = one["blended"] and one["top1_agrees"] and one["rel_err"] <= limit
    return out


def timing(
    llm: Any, size: int, rag: tuple[list[int], list[list[int]]], repeats: int, stats: str
) -> dict:
    """Full prefill and blend, interleaved, round 0 untimed; medians of ``repeats``."""
    warm, asked = rag
    ask(llm, warm, {"blend": False})
    runs: dict[str, list[dict]] = {"full prefill": [], "CacheBlend": []}
    records = []
    for i, ids in enumerate(asked[: repeats + 1]):
        full = ask(llm, ids, {"blend": False})
        before = _count(stats)
        blend = ask(llm, ids, None)
        if i > 0:
            runs["full prefill"].append(full)
            runs["CacheBlend"].append(blend)
            records.append(_record(stats, before) or {})
    blended = [r for r in records if r.get("blended", True) and not r.get("fallback_reason")]
    summary: dict[str, Any] = {"part": f"time: {size:,} tokens", "tokens": len(asked[0])}
    for mode, rows in runs.items():
        ttfts = [r["ttft"] for r in rows]
        summary[mode] = {
            "ttft_ms": 1000 * statistics.median(ttfts),
            "spread_ms": [1000 * min(ttfts), 1000 * max(ttfts)],
            "ttft_from": rows[0]["ttft_from"] if rows else None,
            "peak_gib": max(r["peak"] for r in rows) / (1 << 30) if rows else 0.0,
            "extra_gib": statistics.median(r["extra"] for r in rows) / (1 << 30) if rows else 0.0,
        }
    summary["blended"] = f"{len(blended)}/{len(records)}"
    summary["why_not"] = sorted(
        {str(r.get("reason") or r.get("fallback_reason")) for r in records if r not in blended}
    )
    summary["recompute_fraction"] = (
        statistics.mean(r.get("recompute_fraction", 0.0) for r in blended) if blended else None
    )
    summary["ok"] = len(blended) == len(records)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vLLM's engine with the connector (child)")
    parser.add_argument("--shape", choices=sorted(vllm_model.SHAPES), default="llama-3.1-8b")
    parser.add_argument("--sizes", default="2000,8000,32000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="tokens per RAG chunk")
    parser.add_argument("--dtype", choices=sorted(AGREEMENT_LIMIT), default="bfloat16")
    parser.add_argument("--json", required=True)
    parser.add_argument("--work", help="folder for the model folders and the stats file")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-step-"))
    sizes = [int(s) for s in args.sizes.split(",") if s]
    try:
        results = run(args.shape, sizes, args.repeats, work, args.chunk, args.dtype)
    except Exception as exc:  # noqa: BLE001 - e.g. vLLM does not import: one line, not a wall
        results = [failure("import vLLM", exc)]
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
