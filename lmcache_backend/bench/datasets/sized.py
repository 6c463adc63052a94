"""RAG prompts of a given size from the built-in examples, as the one-engine measurements ask
them: a warm-up prompt that stores the chunks, then the chunks reordered with a new question
every request. The profile and the ITL measurement (:mod:`lmcache_backend.bench.profiling`) and
the hardware check's long prompts (:mod:`lmcache_backend.hardware.llama8b`) build theirs here."""

from __future__ import annotations

from lmcache_backend.blend.segmenting import shaped_prompt
from lmcache_backend.data.examples import builtin_examples, reordered


def sized_prompts(tok, size: int, rounds: int, separator: str, shape: str = "separator"):
    """The warm-up prompt and ``rounds`` reordered prompts with new questions, about ``size``
    tokens of ``tok``: 6 profiles a thousand tokens up to 12 chunks, each chunk repeating its
    profile as often as the size needs beyond that.

    ``shape`` (:data:`~lmcache_backend.blend.segmenting.PROMPT_SHAPES`): ``separator`` puts
    ``separator`` before every chunk and the question; ``stock`` is LangChain's stock RAG
    prompt (the chunks joined by blank lines in the system message, the question alone in the
    user message), with no separator; ``text`` the separated prompt as completions text."""
    per_k = max(1, round(size / 1000))
    chunks_n = min(12, 6 * per_k)  # a profile is ~180 tokens (SmolLM2), ~130 (Gemma 3)
    ex = builtin_examples(1, chunks_per_example=chunks_n, seed=size)[0]

    def ids(parts, question):
        return shaped_prompt(tok, shape, ex.system, parts, question, separator)

    once = len(ids(ex.chunks, ex.question))
    repeat = max(1, round(size / once))
    chunks = [" ".join([c] * repeat) for c in ex.chunks]
    asked = reordered(chunks, seed=1)
    warm = ids(chunks, "Which of these people was born first?")
    return warm, [ids(asked, f"{ex.question} (request {i})") for i in range(rounds)]
