"""The load benchmark's requests: a corpus of fictional profiles, Zipf popularity, LangChain's
stock chat shape, and a fact no other request holds (for the correctness check).

Each request takes ``k`` distinct corpus chunks drawn by popularity (the chunk of rank ``r``,
1-based, with weight ``1 / r^s``), in random order, plus one short note only it carries: "visitor
badge ``j`` bears the number ``NNNNN``" with a 5-digit number unique in the run, and asks for
that number. The documents go to the end of the system message joined by blank lines and the
question is the user message, as LangChain's documented RAG chain sends them; the server's default
segmentation (``blend_segmentation=auto``) finds the chunks in blocks.

An answer that holds another request's number shows K/V (or output) of one request reaching
another: :func:`mixed_up` counts them.
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
from dataclasses import dataclass

#: LangChain's documented RAG system prompt (the ``langchain-stock`` shape, docs/frameworks.md)
STOCK_SYSTEM = (
    "You are an assistant for question-answering tasks. "
    "Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you "
    "don't know. Use three sentences maximum and keep the "
    "answer concise."
    "\n\n"
)

_CODE = re.compile(r"(?<!\d)\d{5}(?!\d)")


def corpus(num_chunks: int, seed: int = 0) -> list[str]:
    """``num_chunks`` fictional profiles (one chunk each, ~200 tokens), each about a person of
    its own: names are unique (a Roman-numeral suffix once the name pairs run out)."""
    from lmcache_backend.data.examples import _FIRST, _LAST, _profile

    rng = random.Random(f"load-corpus-{seed}")
    pairs = [f"{f} {s}" for f, s in itertools.product(_FIRST, _LAST)]
    rng.shuffle(pairs)
    out = []
    for i in range(num_chunks):
        name = pairs[i % len(pairs)]
        if i >= len(pairs):
            name += f" {_roman(i // len(pairs) + 1)}"
        out.append(_profile(rng, name)[0])
    return out


def _roman(n: int) -> str:
    out = ""
    for value, letters in ((10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
        while n >= value:
            out, n = out + letters, n - value
    return out


class ZipfSampler:
    """Draws ``k`` distinct indices of ``0..n-1``; index ``i`` has weight ``1 / (i + 1)^s``
    (``s = 0``: uniform). Without replacement: each draw is among the indices not yet taken."""

    def __init__(self, n: int, s: float, rng: random.Random) -> None:
        if n < 1:
            raise ValueError("the corpus needs at least one chunk")
        if s < 0:
            raise ValueError(f"the Zipf exponent must be >= 0, got {s}")
        self.n = n
        self.weights = [1.0 / (i + 1) ** s for i in range(n)]
        self.rng = rng
        self._cum = list(itertools.accumulate(self.weights))

    def probabilities(self) -> list[float]:
        total = self._cum[-1]
        return [w / total for w in self.weights]

    def draw(self, k: int) -> list[int]:
        """``k`` distinct indices, in the order drawn (most popular tend to come first)."""
        if not 0 < k <= self.n:
            raise ValueError(f"cannot draw {k} distinct chunks from {self.n}")
        taken: list[int] = []
        seen: set[int] = set()
        while len(taken) < k:
            if len(seen) * 2 > self.n:  # mostly taken: draw among the rest directly
                rest = [i for i in range(self.n) if i not in seen]
                i = self.rng.choices(rest, weights=[self.weights[j] for j in rest])[0]
            else:
                i = bisect.bisect_right(self._cum, self.rng.random() * self._cum[-1])
                i = min(i, self.n - 1)
            if i not in seen:
                seen.add(i)
                taken.append(i)
        return taken


@dataclass(frozen=True)
class LoadRequest:
    """One request of a phase: its chunks (corpus indices, in prompt order), note and question."""

    index: int
    chunk_ids: tuple[int, ...]
    note_position: int
    badge: int
    code: str
    docs: tuple[str, ...]
    question: str

    def messages(self) -> list[dict[str, str]]:
        """LangChain's stock RAG chat: the documents at the end of the system message, joined
        by blank lines; the question alone in the user message."""
        return [
            {"role": "system", "content": STOCK_SYSTEM + "\n\n".join(self.docs)},
            {"role": "user", "content": self.question},
        ]


def note(badge: int, code: str) -> str:
    return (
        f"Visitor badge {badge} was issued at the front desk this morning. "
        f"The number printed on visitor badge {badge} is {code}."
    )


def build_requests(
    chunks: list[str], count: int, k: int, zipf: float, seed: int = 0, first_badge: int = 1
) -> list[LoadRequest]:
    """``count`` requests over ``chunks``: ``k`` chunks each by Zipf popularity, shuffled, the
    request's own note at a random place among them, its 5-digit code unique in the list."""
    rng = random.Random(f"load-requests-{seed}")
    sampler = ZipfSampler(len(chunks), zipf, rng)
    if count > 90000:
        raise ValueError("at most 90,000 requests per phase (5-digit codes)")
    codes = rng.sample(range(10000, 100000), count)
    out = []
    for j in range(count):
        ids = sampler.draw(k)
        rng.shuffle(ids)
        badge, code = first_badge + j, str(codes[j])
        docs = [chunks[i] for i in ids]
        at = rng.randrange(len(docs) + 1)
        docs.insert(at, note(badge, code))
        out.append(
            LoadRequest(
                index=j,
                chunk_ids=tuple(ids),
                note_position=at,
                badge=badge,
                code=code,
                docs=tuple(docs),
                question=f"What number is printed on visitor badge {badge}?",
            )
        )
    return out


def codes_in(text: str) -> set[str]:
    """The 5-digit numbers in ``text``."""
    return set(_CODE.findall(text))


def mixed_up(answer: str, own: str, all_codes: set[str]) -> set[str]:
    """Other requests' codes found in ``answer`` (empty: the answer is clean)."""
    return (codes_in(answer) & all_codes) - {own}
