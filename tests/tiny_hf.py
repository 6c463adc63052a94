"""Tiny random-weight HF models (Llama, Mistral, Qwen2, Qwen3, Gemma 3; fp32) and RAG-shaped
prompts of random token ids, ``sys + SEP + c1 + SEP + c2 + SEP + c3 + SEP + question``, with a
blender over an in-memory store: what the blend tests build on."""

from __future__ import annotations

import torch

from lmcache_backend.blend import LMCBlender, SegmentCache
from lmcache_backend.config import load_config
from lmcache_backend.integration.hf.engine import hf_full_prefill
from lmcache_backend.models.hf import HFModelAdapter
from lmcache_backend.ops import get_ops
from lmcache_backend.storage import MemoryTier

SEP = [5, 6]
VOCAB = 256


#: Gemma 3 layer kinds: sliding-window layers (a window far shorter than the prompts) with the
#: local RoPE base, global layers with another base and linear scaling; q/k norms; a head dim
#: that is not hidden / heads; a softmax scale that is not head_dim ** -0.5
GEMMA3_WINDOW = 16
GEMMA3 = dict(
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=GEMMA3_WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    },
)


def tiny_model(kind: str) -> torch.nn.Module:
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    config = {
        "llama": lambda: LlamaConfig(**common, rope_theta=10000.0),
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: Qwen2Config(**common),
        "qwen3": lambda: Qwen3Config(**common, head_dim=16),
        "gemma3": lambda: Gemma3TextConfig(**common, **GEMMA3),
    }[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # random init leaves the norms at 1 (Gemma: 1 + 0): perturb them so every norm path is exercised
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data += 0.1 * torch.randn_like(param)
    return model.eval()


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, VOCAB, (n,), generator=g).tolist()


SYS, C1, C2, C3 = rand_ids(12, 1), rand_ids(40, 2), rand_ids(33, 3), rand_ids(51, 4)
Q1, Q2 = rand_ids(9, 5), rand_ids(7, 6)


def rag_prompt(*parts: list[int]) -> list[int]:
    out: list[int] = []
    for part in parts[:-1]:
        out += part + SEP
    return out + parts[-1]


def collect_steps(steps) -> tuple[list, object]:
    """Every item a step generator yields, and its return value."""
    items = []
    while True:
        try:
            items.append(next(steps))
        except StopIteration as done:
            return items, done.value


def setup_blender(
    model,
    ratios=(0.15,),
    check_layers=(1,),
    min_tokens=0,
    selection="kv_deviation",
    position_discount=10.0,
    selection_span=1,
):
    adapter = HFModelAdapter(model)
    # the store beside the model: on the GPU for a test that puts the model there
    store = MemoryTier(adapter.device, 1 << 30, adapter.device.type)
    config = load_config(
        env={},
        enable_blending=True,
        blend_min_tokens=min_tokens,
        blend_recompute_ratios=list(ratios),
        blend_check_layers=list(check_layers),
        blend_selection=selection,
        blend_position_discount=position_discount,
        blend_selection_span=selection_span,
    )
    blender = LMCBlender(store, None, config, adapter, SEP, get_ops("torch"))
    return blender, SegmentCache(store, adapter.fingerprint, SEP)


def warm_store(model, cache: SegmentCache, tokens: list[int]) -> None:
    pre = hf_full_prefill(model, tokens)
    assert cache.store_segments(tokens, pre.keys, pre.values) > 0
