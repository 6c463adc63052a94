"""The connector's whole worker-side blend on a GPU, at Llama-3.1-8B's shape, without vLLM.

What a GPU user asks first -- how much faster is a blended 8k / 32k prompt, how much memory does
it take, and does it agree with full prefill -- needs no engine: the connector's worker path
(:class:`~lmcache_backend.integration.vllm.worker_side.worker.WorkerSide`) takes the KV caches vLLM
hands over and the model's per-layer primitives. This benchmark gives it exactly those:

* **the model**: a Llama-3.1-8B-shaped ``transformers`` model (32 layers, hidden 4,096, 32/8
  heads of 128, MLP 14,336, llama3 RoPE, vocabulary 128,256) with random bf16 weights, built on
  the device (``from_config``), seen through the HF adapter;
* **the caches**: one tensor per layer of each recorded form, allocated in the recorded
  physical order and permuted to the logical shape as the release allocates it
  (``tests/engine_cache_forms.py`` over ``tests/fixtures/engine_contracts``): vLLM 0.33's
  ``[NB, H, BS, 2D]`` in LBNHC order, 0.26's NHD and HND, and 0.10's two 5-D forms;
* **the engine's side** (a stand-in for what vLLM provides, named as such): a ``vllm_config``
  with the block size, cache dtype, the layers' backend name and the vocabulary; the warm
  prompt's K/V written into its blocks as the attention layers would, then stored by
  ``WorkerSide.save`` (the CPU tier, in pinned memory); the question after the blend computed
  by the model over the blended K/V, as vLLM's own forward pass would.

Per form it runs ``register_kv_caches`` -> ``build`` -> ``save`` of a RAG prompt -> ``load`` of
the reordered prompt with a new question: lookup, layer-by-layer load from the CPU tier,
re-rotation, selection, the selected queries' paged attention, write-back. Reported:

* **agreement** (each form, the first size): the blended K/V read back the way the release's
  backend reads its cache, and the last token's logits, against the same model's full prefill
  of the reordered prompt, at ratio 1.0 (must agree within bf16's tolerance) and at the default
  ratio (reported);
* **time and memory** (the newest form, every size): the blend plus the question's forward pass
  against the model's full prefill (SDPA) on the same GPU, each with a new question, interleaved,
  medians of ``--repeats`` rounds after one untimed; the peak device memory during the blend
  and its rise over the allocation before it.

Usage::

    python benchmarks/device_blend.py                       # 8B shape, 8k and 32k, on CUDA
    python benchmarks/device_blend.py --sizes 8000 --repeats 1
    TRITON_INTERPRET=1 python benchmarks/device_blend.py --shape tiny --device cpu \
        --sizes 300 --chunk 48 --repeats 0                   # CPU tensors, the interpreter

``lmcache-backend hardware-check`` runs it in a child (``hardware/device_blend.py``);
``tests/integration/vllm/test_device_blend.py`` runs the tiny shape on CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

# the sibling modules (this file is also loaded by path, from the hardware check and the tests)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_blend_checks import (  # noqa: E402
    AGREEMENT_FACTOR,
    Reference,
    agreement,
    agrees,
    counted,
    fp32_reference,
    gpu_profile,
    timing,
)
from device_blend_setup import (  # noqa: E402
    CHUNK,
    FORMS,
    GIB,
    SHAPES,
    Bench,
    build_model,
    find_form,
    rag_prompts,
)

__all__ = ["AGREEMENT_FACTOR", "FORMS", "SHAPES", "agrees", "find_form", "rag_prompts", "run"]


def run(args: argparse.Namespace) -> dict:
    """Every form's agreement at the first size, the first form's timings at every size."""
    from lmcache_backend.ops import get_ops

    shape = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    model = build_model(shape, args.device, dtype)
    platform = "cuda"  # the CUDA forms and kernels: compiled on a GPU, interpreted on CPU
    get_ops(platform)  # registers the Triton kernels (raises where they cannot load)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    forms = [f for f in args.forms.split(",") if f]
    prompts = {
        s: rag_prompts(s, args.repeats + 1, shape.vocab, seed=s, chunk=args.chunk) for s in sizes
    }
    longest = max(len(p) for warm, asked in prompts.values() for p in [warm, *asked])
    result: dict[str, Any] = {
        "shape": args.shape,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "shape_detail": asdict(shape),
        "agreement": [],
        "timing": [],
        "profile": [],
        "counts": [],
    }
    checked = prompts[sizes[0]][1][0]  # every form blends this prompt
    ref = fp32_reference(model, shape, checked)
    for n, form_id in enumerate(forms):
        bench = Bench(model, find_form(form_id), longest, platform)
        try:
            _one_form(bench, n == 0, sizes if n == 0 else sizes[:1], prompts, ref, args, result)
        finally:
            bench.close()
        del bench
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result["stage_profile"] = stage_profile_of(result["timing"])
    return result


def stage_profile_of(timings: list[dict]) -> dict:
    """Fixed and per-token cost of the blend's phases (the host's time in each), of the whole
    blend and of full prefill, from the timed sizes' medians
    (:mod:`lmcache_backend.bench.profiling.stage_profile`)."""
    from lmcache_backend.bench.profiling.stage_profile import stage_profile

    by_length = {}
    first = timings[0].get("host_load") if timings else None
    for entry in timings:
        if entry.get("host_load") != first:  # one load mode: the first
            continue
        s = summary(entry)
        by_length[s["tokens"]] = {
            **s["phases_ms"],
            "CacheBlend (blend + question)": s["blend_ms"],
            "full prefill": s["full_ms"],
        }
    return stage_profile(by_length)


def _one_form(
    bench: Bench,
    first: bool,
    sizes: list[int],
    prompts: dict,
    ref: Reference,
    args: argparse.Namespace,
    result: dict,
) -> None:
    """Agreement at the first size; on the ``first`` form also naive reuse, the timed rounds
    and the profile at every size."""
    checked = prompts[sizes[0]][1][0]
    for size in sizes:
        warm, asked = prompts[size]
        stored = bench.store(warm)
        if size == sizes[0]:
            # naive reuse (nothing recomputed) once: the default's distance beside it
            for ratio in (1.0, None, 0.0) if first else (1.0, None):
                entry = agreement(bench, checked, ratio, ref)
                entry.update(form=bench.form.id, tokens=len(checked), stored=stored)
                result["agreement"].append(entry)
                print(json.dumps(entry), flush=True)
        for mode in args.host_load.split(",") if first and args.repeats > 0 else ():
            # how the hits reach the GPU layer by layer (blend/layerwise/layer_load.py)
            bench.worker.loads.blender.host_load = mode
            entry = {
                "form": bench.form.id,
                "tokens": len(asked[0]),
                "host_load": mode,
                "runs": timing(bench, asked),
            }
            result["timing"].append(entry)
            print(json.dumps(summary(entry)), flush=True)
        bench.worker.loads.blender.host_load = args.host_load.split(",")[0]
        if first and args.count:
            item = {"tokens": len(asked[-1]), **counted(bench, asked[-1])}
            result["counts"].append(item)
            print(json.dumps(item), flush=True)
        if first and args.profile and args.device == "cuda":
            last = asked[-1]
            item = {
                "tokens": len(last),
                "CacheBlend": gpu_profile(lambda ids=last: bench.blend(ids, None, "profiled")),
                "full prefill": gpu_profile(lambda ids=last: bench.full_prefill(ids)),
            }
            result["profile"].append(item)
            print(json.dumps(item), flush=True)


def summary(entry: dict) -> dict:
    """Medians of one size's timed rounds."""
    full, blend = entry["runs"]["full prefill"], entry["runs"]["CacheBlend"]
    full_ms = 1000 * statistics.median(r["seconds"] for r in full)
    blend_ms = 1000 * statistics.median(r["seconds"] for r in blend)
    return {
        "form": entry["form"],
        "tokens": entry["tokens"],
        "host_load": entry.get("host_load", "staged"),
        "rounds": len(full),
        "full_ms": full_ms,
        "blend_ms": blend_ms,
        "question_ms": 1000 * statistics.median(r["question_seconds"] for r in blend),
        "ratio": blend_ms / full_ms,
        "spread": [
            min(b["seconds"] / f["seconds"] for b, f in zip(blend, full)),
            max(b["seconds"] / f["seconds"] for b, f in zip(blend, full)),
        ],
        "full_peak_gib": max(r["peak"] for r in full) / GIB,
        "full_extra_gib": statistics.median(r["extra"] for r in full) / GIB,
        "blend_peak_gib": max(r["peak"] for r in blend) / GIB,
        "blend_extra_gib": statistics.median(r["extra"] for r in blend) / GIB,
        "recompute_fraction": statistics.mean(r["recompute_fraction"] for r in blend),
        "token_layer_fraction": statistics.mean(r["token_layer_fraction"] for r in blend),
        # the host's milliseconds per phase of the blend (medians; the device may still run)
        "phases_ms": {
            name: statistics.median(r["phases_ms"].get(name, 0.0) for r in blend)
            for name in sorted({k for r in blend for k in r.get("phases_ms", {})})
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sizes", default="8000,32000", help="prompt sizes, tokens")
    parser.add_argument("--forms", default=",".join(FORMS), help="recorded cache forms")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per size")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="tokens per chunk")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more blend and full prefill per size under torch's profiler (GPU only)",
    )
    parser.add_argument(
        "--host-load",
        default="staged",
        help="how the hits in host memory reach the GPU, timed in turn: staged (one copy per "
        "layer from a staging buffer) and/or direct (a copy per hit); the first also serves "
        "the agreement, profile and counts",
    )
    parser.add_argument(
        "--count",
        action="store_true",
        help="one more blend and full prefill per size under the launch counter: kernel "
        "launches and host-device syncs (lmcache_backend/bench/profiling/launch_count.py)",
    )
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def unavailable_reason(device: str) -> str | None:
    """Why the benchmark cannot run on ``device`` here, or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    try:
        import transformers  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable_reason(args.device)
    if reason:
        print(f"device_blend: {reason}", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
