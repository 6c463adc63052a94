"""Tokenizers built on the spot, for tests that need another family than the embedded model's.

:func:`sentencepiece_tokenizer` trains a small SentencePiece BPE model (byte fallback, dummy
prefix: the Llama-2 / Mistral recipe) with the ``sentencepiece`` package and loads it as
``LlamaTokenizerFast`` with a ChatML chat template.
"""

from __future__ import annotations

import os

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by it at from his an were are which this be "
    "or has had not but first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "Alice Bob Carol lives Paris owns cat named Tom plays harp Use context question answer "
    "El gato perro casa Who What Where 1 2 3 2024 # ( ) . , ? ! : ;"
).split()


def _corpus() -> str:
    import random

    rng = random.Random(0)
    lines = []
    for _ in range(3000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", " # # next."]))
    return "\n".join(lines)


def sentencepiece_tokenizer(folder: str | os.PathLike):
    """A Llama-2 style SentencePiece tokenizer saved in (and loaded from) ``folder``."""
    import io

    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus().splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        add_dummy_prefix=True,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    path = os.path.join(folder, "tokenizer.model")
    with open(path, "wb") as fh:
        fh.write(model.getvalue())
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    # What transformers' Llama conversion builds from a SentencePiece BPE model: the pieces and
    # their merges, byte fallback, the "▁" meta-space prepended to the first word only.
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    extracted = SentencePieceExtractor(path).extract(BPE)
    backend = Tokenizer(
        models.BPE(
            extracted["vocab"],
            extracted["merges"],
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Metaspace(replacement="\u2581", prepend_scheme="first"), decoders.ByteFallback()]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok = LlamaTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return LlamaTokenizerFast.from_pretrained(folder)
