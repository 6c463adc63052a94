"""A model folder shaped like Llama-3.1-8B for vLLM's ``load_format="dummy"`` (random weights, no
download), the RAG prompts it is asked, and the engine's arguments.

The folder holds a ``config.json`` with Llama-3.1-8B's shape (32 layers, hidden size 4,096, 32
query and 8 KV heads of 128, MLP 14,336, llama3 RoPE scaling) and the embedded SmolLM2 tokenizer,
with ``vocab_size`` set to the tokenizer's 49,152 (Llama-3's is 128,256): the tokenizer comes
without a hub, and a vocabulary larger than the tokenizer's would let the random weights sample
ids it cannot decode. Only the embedding and LM head shrink (7.4B parameters instead of 8.0B);
every layer, and so the prefill's time and the KV cache per token, is Llama-3.1-8B's.
"""

from __future__ import annotations

import inspect
import math
import shutil
from pathlib import Path
from typing import Any

#: Llama-3.1-8B's config.json, but for the vocabulary (see the module's docstring).
SHAPE: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
ROPE_THETA = 500000.0
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: Prompt sizes in tokens (approximate: the profile's prompt builder, chunks repeated to size).
DEFAULT_SIZES = (8000, 32000)

#: The connector's settings: blending on, and room on the host for a 32k prompt's chunks (4 GiB
#: of bf16 K/V for this shape) next to the 8k one's.
EXTRA_CONFIG = {"enable_blending": True, "max_local_cpu_size": 16.0}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_folder(cache: Path) -> Path:
    """Write (once per transformers version: the config format differs) the model folder."""
    import transformers
    from transformers import AutoTokenizer, LlamaConfig

    from lmcache_backend.data.embedded import embedded_model_path

    folder = cache / f"llama-3.1-8b-shape-tf{transformers.__version__}"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(embedded_model_path())
    for name in _TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    tok = AutoTokenizer.from_pretrained(str(folder))
    kwargs: dict[str, Any] = {
        **SHAPE,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    # transformers 5 takes the RoPE settings as one dict, 4.x as rope_theta + rope_scaling
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_theta": ROPE_THETA, **ROPE_SCALING}
    else:
        kwargs.update(rope_theta=ROPE_THETA, rope_scaling=dict(ROPE_SCALING))
    config = LlamaConfig(**kwargs)
    config.architectures = ["LlamaForCausalLM"]  # the engine is given dtype=bfloat16 itself
    config.save_pretrained(str(folder))
    return folder


def build_prompts(
    folder: Path, sizes: list[int], rounds: int
) -> dict[int, tuple[list[int], list[list[int]]]]:
    """Per size: the warm-up prompt (chunks in their stored order, one question) and ``rounds``
    prompts with the chunks reordered and a new question each, built as the profile builds its
    own (:func:`~lmcache_backend.bench.datasets.sized.sized_prompts`)."""
    from transformers import AutoTokenizer

    from lmcache_backend.bench.datasets.sized import sized_prompts
    from lmcache_backend.config import load_config

    tok = AutoTokenizer.from_pretrained(str(folder))
    separator = load_config().blend_special_str
    return {size: sized_prompts(tok, size, rounds, separator) for size in sizes}


def engine_kwargs(longest: int, graphs: bool = True) -> dict[str, Any]:
    """``offline_engine`` arguments: dummy bf16 weights, prefix caching off (a repeated prompt
    would otherwise be served from vLLM's own cache, not prefilled or blended), CUDA/ACL graphs
    as vLLM serves by default, a context that holds the longest prompt and its answer."""
    return {
        "load_format": "dummy",
        "dtype": "bfloat16",
        "enforce_eager": not graphs,
        "enable_prefix_caching": False,
        "max_model_len": 1 << math.ceil(math.log2(longest + 16)),
        "gpu_memory_utilization": 0.9,
        "seed": 0,
    }
