"""Benchmark examples: the built-in set, a JSONL file, and longer prompts for the sweep."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmcache_backend.data.examples import (
    DatasetError,
    RagExample,
    builtin_examples,
    load_examples,
    reordered,
)

DEFAULT_COUNT = 12
#: The question of the warm-up prompts. Real RAG questions are new: the asked question never
#: comes from the cache (the query tail is never stored either), and warming with another
#: question keeps engines with a prefix cache from holding it.
WARM_QUESTION = "Summarize the documents in one sentence."
#: ``--dataset dev``: the shipped, calibrated dev set (see
#: :mod:`lmcache_backend.bench.datasets.devset`).
DEV_DATASET = "dev"


@dataclass(frozen=True)
class PromptPair:
    """One benchmark case.

    Attributes:
        example: the RAG example.
        warm_ids: the chunks in their original order with :data:`WARM_QUESTION` (fills the
            caches).
        asked_ids: the chunks reordered with the example's question (the one every strategy
            answers).
    """

    example: RagExample
    warm_ids: list[int]
    asked_ids: list[int]


def _nonblank_line_numbers(path: str | Path) -> list[int]:
    with open(path, encoding="utf-8") as fh:
        return [n for n, line in enumerate(fh, start=1) if line.strip()]


def load_dataset(
    path: str | Path | None = None, count: int = DEFAULT_COUNT, model: str | None = None
) -> list[RagExample]:
    """The examples of a JSONL file (``"dev"``: the shipped dev set of ``model``, an embedded
    model's name, None for the default one), or ``count`` built-in ones when ``path`` is None.
    ``FILE@TOKENS`` (``dev@16000``): the same examples grown to about ``TOKENS`` prompt tokens of
    ``model``'s tokenizer (:mod:`lmcache_backend.bench.datasets.long_context`).
    ``musique[@PASSAGES]`` (or a ``.json`` file in its format): the CacheBlend paper's MuSiQue
    examples (:mod:`lmcache_backend.bench.datasets.musique`).

    Raises:
        DatasetError: a line is malformed (see :func:`lmcache_backend.data.examples.load_examples`),
            an example has fewer than two chunks (nothing to reorder) or repeats an earlier id;
            the message names the file, the line and the field; no dev set ships for
            ``model``.
    """
    if path is None:
        return builtin_examples(count=count)
    from lmcache_backend.bench.datasets.musique import is_musique, load_musique

    if is_musique(str(path)):
        return load_musique(str(path))
    from lmcache_backend.bench.datasets.long_context import split_length

    path, long_tokens = split_length(str(path))
    if long_tokens is not None:
        return _long(load_dataset(path, count, model), long_tokens, model)
    if str(path) == DEV_DATASET:
        from lmcache_backend.bench.datasets.devset import devset_path

        path = devset_path(model)
    examples = load_examples(path)
    lines = _nonblank_line_numbers(path)
    seen: dict[str, int] = {}
    for example, line in zip(examples, lines):
        where = f"{path}:{line}"
        if len(example.chunks) < 2:
            raise DatasetError(
                f"{where}: field 'chunks' needs at least 2 chunks so they can be reordered, "
                f"got {len(example.chunks)}"
            )
        if example.id in seen:
            raise DatasetError(
                f"{where}: field 'id' repeats {example.id!r} (first on line {seen[example.id]})"
            )
        seen[example.id] = line
    return examples


PromptBuilder = Callable[[str, Sequence[str], str], list[int]]


def prompt_pair(build: PromptBuilder, example: RagExample, seed: int = 0) -> PromptPair:
    """Token ids of ``example``: its chunks in order with :data:`WARM_QUESTION`, and reordered
    (rotation by ``seed``) with its own question.

    ``build(system, chunks, question)`` makes a blend-ready prompt (an engine's ``prompt_ids``).
    """
    warm = build(example.system, example.chunks, WARM_QUESTION)
    asked = build(example.system, reordered(example.chunks, seed), example.question)
    return PromptPair(example, list(warm), list(asked))


def sweep_example(
    count_tokens: Callable[[str], int], target_tokens: int, num_chunks: int, seed: int = 7
) -> RagExample:
    """An example of about ``target_tokens`` prompt tokens split into ``num_chunks`` chunks.

    Built-in profiles (~170 tokens each) are dealt round-robin into the chunks until the target is
    reached; the question is about one of them. Above 16 profiles, profiles of further generated
    sets are added, whose names may repeat: use these prompts for timing, not for accuracy.
    """
    if num_chunks < 2:
        raise ValueError(f"the sweep needs at least 2 chunks, got {num_chunks}")
    base = builtin_examples(count=1, chunks_per_example=16, seed=seed)[0]
    per_profile = count_tokens(base.chunks[0])
    # Headroom for the system part, separators and question (~60 tokens with SmolLM2).
    needed = max(num_chunks, math.ceil(max(target_tokens - 60, 1) / per_profile))
    profiles = list(base.chunks)
    extra_seed = seed
    while len(profiles) < needed:
        extra_seed += 1
        profiles += builtin_examples(count=1, chunks_per_example=16, seed=extra_seed)[0].chunks
    # Keep the profile the question is about (it is somewhere in the first set).
    answer_index = next((i for i, p in enumerate(base.chunks) if base.answers[0] in p), 0)
    chosen = [profiles[answer_index]] + [p for i, p in enumerate(profiles) if i != answer_index]
    chosen = chosen[:needed]
    chunks = [" ".join(chosen[i::num_chunks]) for i in range(num_chunks)]
    return RagExample(
        id=f"sweep-{target_tokens}t-{num_chunks}c",
        system=base.system,
        chunks=chunks,
        question=base.question,
        answers=base.answers,
    )


def _long(examples: list[RagExample], tokens: int, model: str | None) -> list[RagExample]:
    """``examples`` grown to about ``tokens`` tokens of ``model``'s tokenizer."""
    from transformers import AutoTokenizer

    from lmcache_backend.bench.datasets.long_context import long_context_examples
    from lmcache_backend.data.embedded import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    return long_context_examples(
        examples, tokens, lambda text: len(tok.encode(text, add_special_tokens=False))
    )
