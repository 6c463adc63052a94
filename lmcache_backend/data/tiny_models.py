"""Tiny random-weight models of every architecture the vLLM adapter claims, built from configs.

Used by the tests and by ``lmcache-backend hardware-check`` (its verify step), which runs
installed, so the writer lives in the package; ``tests/tiny_models.py`` re-exports it.

Each model borrows the embedded SmolLM2 tokenizer (so the built-in prompts and the separator
tokenize), has 2 layers, hidden size 128, 4 query / 2 KV heads of 64 and is saved as safetensors
in fp32. Weights are drawn with a larger spread than the usual init so greedy decoding is decided
by clear margins rather than near-ties.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

#: name -> (HF config class, architecture, extra config)
SPECS: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # vLLM's Qwen2 takes head_dim = hidden_size / heads, whatever the config says
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"hidden_size": 256}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "llama31": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    "qwen3_yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
    ),
    # a sliding-window layer (a 16-token window, far shorter than the prompts, local RoPE base)
    # and a global one (another base, linear scaling); Gemma's norms, q/k norms, a softmax scale
    # that is not head_dim ** -0.5
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "query_pre_attn_scalar": 48,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        },
    ),
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model(name: str, folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny ``name`` model (a key of :data:`SPECS`) into ``folder``; returns it."""
    import torch
    import transformers

    from lmcache_backend.data.embedded import embedded_model_path

    cls_name, arch, extra = SPECS[name]
    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(embedded_model_path())
    for file in _TOKENIZER_FILES:
        if (source / file).exists():
            shutil.copy(source / file, folder / file)
    base = json.loads((source / "config.json").read_text())
    kwargs = {
        "vocab_size": base["vocab_size"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": base["bos_token_id"],
        "eos_token_id": base["eos_token_id"],
        "pad_token_id": base.get("pad_token_id"),
        "initializer_range": 0.08,
        **extra,
    }
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    os.sync()
    return folder
