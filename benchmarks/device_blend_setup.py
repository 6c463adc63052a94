"""The model, prompts, cache forms and engine stand-in of ``benchmarks/device_blend.py``: a
Llama model of a given shape with random weights on a device, RAG prompts of random ids, and
:class:`Bench`, the connector's worker (``WorkerSide``) over freshly allocated caches of one
recorded form, driven as vLLM would drive it."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
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
        from lmcache_backend.integration.vllm.worker_side.worker import WorkerSide
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
            time_phases=True,  # the host's time per phase of the blend (the stage profile)
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
            "phases_ms": dict(record.phases_ms or {}),
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
