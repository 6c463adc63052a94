"""Long-context variants of a dev set: each example's gold profile among many distractors.

``lmcache-backend bench --dataset dev@16000`` (any dev set or JSONL file, ``@`` and a token
count) turns every example into one of about that many prompt tokens: its gold chunk (the
profile the question is about) kept as it is, its other chunks replaced by longer ones, each
``PROFILES_PER_CHUNK`` fictional profiles from the load benchmark's generator (a different person
each, none sharing the gold person's first or last name), as many as the length needs. The gold
chunk sits at a depth that cycles through :data:`DEPTHS` from one example to the next, so a run
covers the fact near the start, in the middle and near the end. The question, its answers and
the calibration of the base set (answered from the gold chunk alone, not without context) carry
over unchanged; lengths are counted with the benchmarked model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmcache_backend.bench.datasets.devset import gold_chunk
from lmcache_backend.bench.load_test.workload import corpus
from lmcache_backend.data.examples import DatasetError, RagExample

#: where the gold chunk sits, as a share of the chunks before it
DEPTHS = (0.1, 0.5, 0.9)
#: distractor profiles per chunk (about 500-700 tokens a chunk)
PROFILES_PER_CHUNK = 4
#: tokens a chunk's separator and the prompt's framing may add, per chunk
SEPARATOR_ALLOWANCE = 8


def split_length(path: str) -> tuple[str, int | None]:
    """``"dev@16000"`` -> ``("dev", 16000)``; a path without ``@`` -> ``(path, None)``.

    Raises:
        DatasetError: the part after ``@`` is not a token count of at least 1,000.
    """
    base, sep, size = str(path).rpartition("@")
    if not sep:
        return str(path), None
    if not size.isdigit() or int(size) < 1000:
        raise DatasetError(f"--dataset {path!r}: expected FILE@TOKENS with TOKENS >= 1000")
    return base, int(size)


def _names(profile: str) -> tuple[str, str]:
    """First and last name of a profile (``Profile of <first> <last>[ <suffix>]. ...``)."""
    words = profile.split(".", 1)[0].removeprefix("Profile of ").split()
    return words[0], words[1]


def long_context_examples(
    examples: Sequence[RagExample],
    target_tokens: int,
    count_tokens: Callable[[str], int],
    seed: int = 0,
) -> list[RagExample]:
    """Every example grown to about ``target_tokens`` prompt tokens (see the module docstring);
    ids gain ``@<tokens>``."""
    pool = corpus(2000, seed=seed + 7)
    out = []
    for i, ex in enumerate(examples):
        gold = gold_chunk(ex)
        first, last = _names(gold)
        distractors = [p for p in pool if first not in _names(p) and last not in _names(p)]
        start = (i * 97) % len(distractors)  # each example its own distractors
        distractors = distractors[start:] + distractors[:start]
        budget = target_tokens - count_tokens(ex.system) - count_tokens(ex.question)
        budget -= count_tokens(gold)
        chunks: list[str] = []
        taken = 0
        while taken + PROFILES_PER_CHUNK <= len(distractors):
            chunk = " ".join(distractors[taken : taken + PROFILES_PER_CHUNK])
            cost = count_tokens(chunk) + SEPARATOR_ALLOWANCE
            if cost > budget:  # stay under the length (a model's context may end there)
                break
            taken += PROFILES_PER_CHUNK
            chunks.append(chunk)
            budget -= cost
        depth = DEPTHS[i % len(DEPTHS)]
        chunks.insert(round(depth * len(chunks)), gold)
        out.append(
            RagExample(f"{ex.id}@{target_tokens}", ex.system, chunks, ex.question, ex.answers)
        )
    return out
