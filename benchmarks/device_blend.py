"""The connector's whole worker-side blend on a GPU, at Llama-3.1-8B's shape, without vLLM.

What a GPU user asks first -- how much faster is a blended 8k / 32k prompt, how much memory does
it take, and does it agree with full prefill -- needs no engine: the connector's worker path
(:class:`~lmcache_backend.integration.vllm.worker.WorkerSide`) takes the KV caches vLLM hands
over and the model's per-layer primitives. This benchmark gives it exactly those:

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
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

_TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

from engine_cache_forms import Geometry, Recorded, backend_rows, build_cache, recorded_tensors  # noqa: E402

#: The recorded forms the blend runs on, newest first; the first is timed at every size.
FORMS = (
    "0.33.0-FLASH_ATTN-LBNHC",
    "0.26.0-FLASH_ATTN-NHD",
    "0.26.0-FLASH_ATTN-HND",
    "0.10.2-FLASH_ATTN-NHD",
    "0.10.2-FLASHINFER-HND",
)

BLOCK_SIZE = 16
SEPARATOR = [5, 6]
#: chunk, system prompt and question lengths of the RAG prompts (tokens)
CHUNK, SYSTEM, QUESTION = 512, 64, 32
GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """A Llama model's shape (``LlamaConfig`` fields)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    llama3_rope: bool


SHAPES = {
    # Llama-3.1-8B's config.json: only the weights are random
    "llama-3.1-8b": Shape(4096, 14336, 32, 32, 8, 128, 128256, True),
    # the same code at a size Triton's interpreter runs on two CPU cores
    "tiny": Shape(256, 512, 2, 8, 2, 128, 512, True),
}


def build_model(shape: Shape, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``shape`` with random weights, created on ``device``."""
    import inspect

    from transformers import AutoModelForCausalLM, LlamaConfig

    rope = {"rope_theta": 500000.0}
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    kwargs: dict[str, Any] = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    # transformers 5 takes the RoPE settings as one dict, 4.x as rope_theta + rope_scaling
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = {**rope, **(scaling if shape.llama3_rope else {})}
    else:
        kwargs.update(rope, rope_scaling=dict(scaling) if shape.llama3_rope else None)
    config = LlamaConfig(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def rag_prompts(
    size: int, rounds: int, vocab: int, seed: int = 0, chunk: int = CHUNK
) -> tuple[list[int], list[list[int]]]:
    """The warm prompt ``system, chunk 1..n, question 0`` of about ``size`` tokens (chunks of
    ``chunk`` tokens, at least two), and ``rounds`` prompts with the chunks in a new order and
    a new question each (random ids above the separator's)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    n_chunks = max(2, (size - SYSTEM - QUESTION) // (chunk + len(SEPARATOR)))
    system, chunks = ids(SYSTEM), [ids(chunk) for _ in range(n_chunks)]

    def prompt(order: list[int], question: list[int]) -> list[int]:
        out = list(system)
        for i in order:
            out += SEPARATOR + chunks[i]
        return out + SEPARATOR + question

    warm = prompt(list(range(n_chunks)), ids(QUESTION))
    asked = [
        prompt(torch.randperm(n_chunks, generator=gen).tolist(), ids(QUESTION))
        for _ in range(rounds)
    ]
    return warm, asked


def find_form(form_id: str) -> Recorded:
    for recorded in recorded_tensors():
        if recorded.id == form_id:
            return recorded
    raise KeyError(f"no recorded cache form {form_id}")


def engine_stand_in(layer_names: list[str], backend: str, vocab: int) -> SimpleNamespace:
    """The parts of vLLM's ``VllmConfig`` the worker reads (a stand-in: no vLLM here)."""
    backend_class = SimpleNamespace(get_name=lambda: backend)
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
        compilation_config=SimpleNamespace(
            static_forward_context={
                name: SimpleNamespace(attn_backend=backend_class) for name in layer_names
            }
        ),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
    )


class Bench:
    """One model, one cache form: the worker over freshly allocated caches."""

    def __init__(self, model: torch.nn.Module, form: Recorded, max_tokens: int, platform: str):
        from lmcache_backend.config import load_config
        from lmcache_backend.integration.vllm.settings import ConnectorSettings
        from lmcache_backend.integration.vllm.worker import WorkerSide
        from lmcache_backend.models.hf import HFModelAdapter

        self.model, self.form = model, form
        cfg = model.config
        self.device = model.device
        blocks_per_prompt = -(-max_tokens // BLOCK_SIZE)
        geometry = Geometry(
            model.dtype,
            cfg.num_key_value_heads,
            cfg.head_dim,
            num_blocks=2 * blocks_per_prompt + 1,
            block_size=BLOCK_SIZE,
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(cfg.num_hidden_layers)]
        caches = {n: build_cache(form.tensor, geometry, str(self.device)) for n in names}
        # the CPU tier holds one prompt's chunks (bf16 K/V of every layer) with room to spare;
        # no device tier: hits come from pinned host memory, as on a default GPU engine
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
        cpu_gb = max(1.0, 2 * max_tokens * kv_bytes / GIB)
        self.config = load_config(
            env={},
            enable_blending=True,
            backend=platform,
            extra_config={
                "segment_index": False,
                "max_local_cpu_size": cpu_gb,
                "max_local_device_size": 0,
            },
        )
        settings = ConnectorSettings(
            config=self.config,
            instance_id=f"device-blend-{form.id}",
            tp_size=1,
            separator=SEPARATOR,
            stats_file=None,
            allow_untested_versions=False,
        )
        profile = SimpleNamespace(kv_transfer_after_model_load=False)
        stand_in = engine_stand_in(names, form.name, cfg.vocab_size)
        self.worker = WorkerSide(settings, stand_in, profile, platform=platform)
        self.worker.register_kv_caches(caches)
        self.worker.build(HFModelAdapter(model))
        # warm prompts take blocks 1.., reordered ones the blocks after them, highest first
        self.first_asked_block = blocks_per_prompt + 1

    def blocks(self, num_tokens: int, asked: bool) -> list[int]:
        n = -(-num_tokens // BLOCK_SIZE)
        if not asked:
            return list(range(1, n + 1))
        first = self.first_asked_block
        return list(range(first + n - 1, first - 1, -1))

    def store(self, warm: list[int]) -> int:
        """Prefill ``warm`` with the model, write its K/V into its blocks as vLLM's attention
        layers do, and store its segments; how many were stored."""
        from lmcache_backend.integration.hf.engine import hf_full_prefill
        from lmcache_backend.integration.vllm.layouts import slots_for
        from lmcache_backend.integration.vllm.metadata import SaveSpec

        blocks = self.blocks(len(warm), asked=False)
        prefill = hf_full_prefill(self.model, warm)
        slots = slots_for(blocks, BLOCK_SIZE, 0, len(warm)).to(self.device)
        for layer, cache in enumerate(self.worker.caches):
            self.worker.layout.write(cache, prefill.keys[layer], prefill.values[layer], slots)
        del prefill
        return self.worker.save(SaveSpec(f"warm-{len(warm)}", warm, blocks))

    def blend(self, asked: list[int], ratio: float | None, tag: str) -> dict:
        """``load`` of ``asked`` (its question excluded, as vLLM computes it), timed, with the
        device memory it took; ``ratio`` None: the default."""
        from lmcache_backend.integration.vllm.metadata import LoadSpec

        config = None if ratio is None else self.config.replace(blend_recompute_ratios=[ratio])
        end = len(asked) - QUESTION
        spec = LoadSpec(tag, asked, self.blocks(len(asked), asked=True), 0, end, config=config)
        resting = _reset_peak(self.device)
        start = time.perf_counter()
        record = self.worker.load(spec)
        _sync(self.device)
        seconds = time.perf_counter() - start
        peak = _peak(self.device)
        if record.fallback_reason is not None:
            raise RuntimeError(f"the blend fell back: {record.fallback_reason}")
        return {
            "seconds": seconds,
            "peak": peak,
            "extra": peak - resting,
            "recompute_fraction": record.recompute_fraction,
            "token_layer_fraction": record.token_layer_fraction,
        }

    def blended_kv(self, asked: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's ``[end, Hkv, D]`` K/V of ``asked``'s blended tokens, read from the
        cache the way the release's attention backend reads it."""
        end = len(asked) - QUESTION
        blocks = torch.tensor(self.blocks(len(asked), asked=True), device=self.device)
        positions = torch.arange(end, device=self.device)
        block_of, offset = blocks[positions // BLOCK_SIZE], positions % BLOCK_SIZE
        head_dim = self.model.config.head_dim
        keys, values = [], []
        for cache in self.worker.caches:
            k, v = backend_rows(self.form, cache, head_dim, block_of, offset)
            keys.append(k)
            values.append(v)
        return keys, values

    def question_logits(self, asked: list[int], keys, values) -> tuple[torch.Tensor, float]:
        """The question's forward pass over the blended K/V (what vLLM computes after the
        blend): the last token's logits ``[V]`` (fp32) and the pass's seconds."""
        from lmcache_backend.integration.hf.engine import kv_to_dynamic_cache

        cache = kv_to_dynamic_cache(self.model, keys, values, every_row=True)
        ids = torch.tensor([asked[len(asked) - QUESTION :]], device=self.device)
        _sync(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        _sync(self.device)
        return logits, time.perf_counter() - start

    def full_prefill(self, ids: list[int]) -> dict:
        """The model's own prefill of ``ids`` (SDPA, no cache kept: vLLM's is preallocated),
        timed, with its device memory."""
        tokens = torch.tensor([ids], device=self.device)
        resting = _reset_peak(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model(input_ids=tokens, use_cache=False, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        _sync(self.device)
        seconds = time.perf_counter() - start
        peak = _peak(self.device)
        return {"seconds": seconds, "peak": peak, "extra": peak - resting, "logits": logits}

    def close(self) -> None:
        self.worker.shutdown()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def _peak(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def compare_logits(blend: torch.Tensor, full: torch.Tensor) -> dict:
    """Relative error, whether the argmax agrees, and KL(full || blend) of two ``[V]``."""
    log_full, log_blend = full.log_softmax(-1), blend.log_softmax(-1)
    kl = float((log_full.exp() * (log_full - log_blend)).sum())
    return {
        "logits_rel_err": relative_error(blend, full),
        "top1_agrees": bool(blend.argmax() == full.argmax()),
        "kl": kl,
    }


@dataclass
class Reference:
    """The model's full prefill of one prompt in fp32 (the same weights): per-layer ``[T, Hkv,
    D]`` K/V and the last token's logits ``[V]``, and how far the bf16 full prefill is from it
    (``kv_err``: worst layer; ``logits_err``) -- the error a bf16 prefill carries anyway."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    kv_err: float
    logits_err: float


def fp32_reference(model: torch.nn.Module, shape: Shape, ids: list[int]) -> Reference:
    """Full prefill of ``ids`` by an fp32 copy of ``model`` (built, loaded, used, dropped), and
    the bf16 full prefill's distance from it."""
    from lmcache_backend.integration.hf.engine import hf_full_prefill

    device = model.device
    wide = build_model(shape, str(device), torch.float32)
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = hf_full_prefill(wide, ids)
    del wide
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with torch.no_grad():
        full = hf_full_prefill(model, ids)
    kv_err = _worst_layer(full.keys, full.values, ref.keys, ref.values, len(ids))
    return Reference(
        ref.keys, ref.values, ref.logits, kv_err, relative_error(full.logits, ref.logits)
    )


def _worst_layer(keys, values, want_keys, want_values, rows: int) -> float:
    """The largest relative error of any layer's K or V (first ``rows`` rows); NaN if any is."""
    errors = [
        relative_error(got[:rows].float(), want[:rows].float())
        for pair in ((keys, want_keys), (values, want_values))
        for got, want in zip(*pair)
    ]
    return float("nan") if any(e != e for e in errors) else max(errors)


#: the blend at ratio 1.0 may be this many times as far from the fp32 prefill as the bf16 full
#: prefill is: the same arithmetic in bf16, rounded in other orders (tiled online softmax and
#: per-layer kernels against SDPA)
AGREEMENT_FACTOR = 2.0


def agreement(bench: Bench, asked: list[int], ratio: float | None, ref: Reference) -> dict:
    """Blend ``asked`` at ``ratio``; its K/V and last-token logits against the bf16 full
    prefill's and the fp32 reference's."""
    from lmcache_backend.integration.hf.engine import hf_full_prefill

    got = bench.blend(asked, ratio, f"agree-{ratio}")
    keys, values = bench.blended_kv(asked)
    logits, _ = bench.question_logits(asked, keys, values)
    with torch.no_grad():
        full = hf_full_prefill(bench.model, asked)
    end = len(asked) - QUESTION
    return {
        "ratio": ratio,
        "kv_rel_err": _worst_layer(keys, values, full.keys, full.values, end),
        **compare_logits(logits, full.logits),
        "kv_err_fp32": _worst_layer(keys, values, ref.keys, ref.values, end),
        "logits_err_fp32": relative_error(logits, ref.logits),
        "bf16_kv_err_fp32": ref.kv_err,
        "bf16_logits_err_fp32": ref.logits_err,
        "token_layer_fraction": got["token_layer_fraction"],
    }


def agrees(entry: dict) -> bool:
    """At ratio 1.0: the blend is no farther from the fp32 prefill than
    :data:`AGREEMENT_FACTOR` times the bf16 full prefill, and picks its next token."""
    return (
        entry["kv_err_fp32"] <= AGREEMENT_FACTOR * entry["bf16_kv_err_fp32"]  # NaN fails
        and entry["logits_err_fp32"] <= AGREEMENT_FACTOR * entry["bf16_logits_err_fp32"]
        and entry["top1_agrees"]
    )


def timing(bench: Bench, asked_rounds: list[list[int]]) -> dict:
    """Round 0 untimed, then blend + question against full prefill, interleaved."""
    runs: dict[str, list[dict]] = {"full prefill": [], "CacheBlend": []}
    for i, asked in enumerate(asked_rounds):
        full = bench.full_prefill(asked)
        full.pop("logits")
        blend = bench.blend(asked, None, f"timed-{i}")
        keys, values = bench.blended_kv(asked)
        _, question_s = bench.question_logits(asked, keys, values)
        del keys, values
        blend["question_seconds"] = question_s
        blend["seconds"] += question_s
        if i > 0:
            runs["full prefill"].append(full)
            runs["CacheBlend"].append(blend)
    return runs


def gpu_profile(fn) -> dict:
    """``fn()`` under torch's profiler: wall ms, the GPU kernels' summed ms and count, and the
    five ops with the most GPU time. Kernels summing to far less than the wall time mean the
    host's launches set the pace."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_op = sorted(
        prof.key_averages(), key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True
    )
    return {
        "wall_ms": 1000 * wall,
        "kernel_ms": sum(e.device_time for e in kernels) / 1000,
        "kernels": len(kernels),
        "top": [
            [e.key[:60], round(getattr(e, "self_device_time_total", 0) / 1000, 2)]
            for e in by_op[:5]
        ],
    }


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
    return result


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
        if first and args.repeats > 0:
            entry = {"form": bench.form.id, "tokens": len(asked[0]), "runs": timing(bench, asked)}
            result["timing"].append(entry)
            print(json.dumps(summary(entry)), flush=True)
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
