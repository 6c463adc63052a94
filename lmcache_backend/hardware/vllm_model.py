"""Model folders for the vLLM step: a ``config.json`` for ``load_format="dummy"`` and a small
tokenizer made here, so that no weights and no tokenizer files are downloaded.

Two shapes: Llama-3.1-8B's (32 layers, hidden 4,096, 32 query / 8 KV heads of 128, MLP 14,336,
llama3 RoPE, vocabulary 128,256) and a tiny Llama with the same structure for the smoke step and
the CPU rehearsal.

The tokenizer is a character-level ``tokenizers`` model: ids 0-2 are ``<unk>``, ``<s>``, ``</s>``,
then every printable ASCII character, the rest of the vocabulary placeholder words (``t<id>``) that
text never produces. Prompts are sent as token ids (random ids from the placeholder range), so
the tokenizer's only jobs are vLLM's detokenizing and the connector's deriving the separator's
ids from ``blend_special_str`` (``" # # "``: the id of ``#`` twice).
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path
from typing import Any

#: Llama-3.1-8B's config.json (HF names).
LLAMA_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}
#: the same structure, small enough for a CPU (and a quick GPU smoke test)
TINY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 131072,
}
SHAPES = {"llama-3.1-8b": LLAMA_8B, "tiny": TINY}

_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

_SPECIAL = ("<unk>", "<s>", "</s>")
#: the characters the tokenizer knows (whitespace is dropped between them)
CHARACTERS = [c for c in string.printable if not c.isspace()]
#: the first id that text never produces: prompts draw their ids from here on
FIRST_FREE_ID = len(_SPECIAL) + len(CHARACTERS)


def _tokenizer_json(vocab_size: int) -> dict:
    """A ``tokenizers`` WordLevel model over single characters (whitespace split off first)."""
    vocab = {tok: i for i, tok in enumerate([*_SPECIAL, *CHARACTERS])}
    vocab.update({f"t{i}": i for i in range(FIRST_FREE_ID, vocab_size)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in enumerate(_SPECIAL)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "WhitespaceSplit"},
                {
                    "type": "Split",
                    "pattern": {"Regex": "."},
                    "behavior": "Isolated",
                    "invert": False,
                },
            ],
        },
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def write_folder(folder: Path, shape: str, max_len: int) -> Path:
    """Write the model folder of ``shape`` (``SHAPES``) with room for ``max_len`` tokens."""
    config = {**_COMMON, **SHAPES[shape]}
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    tokenizer = _tokenizer_json(config["vocab_size"])
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return folder


def context_length(longest_prompt: int, answer: int = 16) -> int:
    """``max_model_len`` for prompts up to ``longest_prompt`` tokens: the next power of two."""
    return 1 << math.ceil(math.log2(longest_prompt + answer))


def char_id(character: str) -> int:
    """The id the tokenizer gives ``character``."""
    return len(_SPECIAL) + CHARACTERS.index(character)


#: the ids of the connector's default separator ``" # # "`` with this tokenizer
SEPARATOR_IDS = [char_id("#"), char_id("#")]
