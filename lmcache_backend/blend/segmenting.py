"""Split prompts into segments, and build blend-ready prompts.

Segments follow LMCache's "special token" (SPT) convention: a chunk ends with the separator, so
``[x, x, x, S, y, y, S, z, z]`` (``S`` the separator's ids) gives ``[x, x, x, S]``, ``[y, y, S]``
and ``[z, z]``.

The separator is matched as it tokenizes *inside running text*, not as it encodes alone. With
a byte-level BPE tokenizer (Llama-3, Qwen, SmolLM2) ``" # # "`` alone encodes to
``[' #', ' #', ' ']``, but in ``"... gato. # # El perro ..."`` the trailing space merges into
the next word: ``['.', ' #', ' #', ' El', ' perro']``. :func:`separator_pattern` finds, per
tokenizer, the ids the separator always produces between words (here ``[' #', ' #']``); a
segment ends right after them and the separator's trailing whitespace belongs to the next
chunk's first token (``' El'``). So a chat message holding
``"<system> # # chunk 1 # # chunk 2 # # question"`` splits into the same segments, with the same
ids, as :func:`build_blend_prompt` produces: both tokenize the whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Words put on each side of the separator to see how it tokenizes between words. The right-hand
#: words start differently (letter, capital, digit) so that only ids the separator produces
#: whatever follows it are kept.
_PROBE_LEFT = ("a", "Hello world.", "x1")
_PROBE_RIGHT = ("b", "The", "1", "(")


@dataclass(frozen=True)
class Segment:
    """Tokens ``start`` (inclusive) to ``end`` (exclusive) of a prompt."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


#: ``held(segments)`` -> per segment, whether the store holds its K/V.
Held = Callable[[list[Segment]], list[bool]]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return list(a[:n])


@dataclass(frozen=True)
class SeparatorPattern:
    """The separator as token ids, and where it places segment boundaries.

    Attributes:
        ids: the ids to match: what the separator produces inside text (see the module
            docstring). A segment ends right after each occurrence; occurrences do not overlap.
        text: the separator string (``blend_special_str``), when known.
    """

    ids: tuple[int, ...]
    text: str | None = None

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError("separator must hold at least one token id")

    def split(self, tokens: Sequence[int]) -> list[Segment]:
        """Every segment of ``tokens``, the query tail included (see :func:`split_segments`)."""
        return split_segments(tokens, self.ids)

    def query_start(self, tokens: Sequence[int]) -> int:
        """Where the query tail starts: right after the last separator (0 if there is none)."""
        segments = self.cacheable_segments(tokens)
        return segments[-1].end if segments else 0

    def cacheable(self, tokens: Sequence[int], segment: Segment) -> bool:
        """Whether ``segment`` ends with the separator: a system part or a chunk."""
        return ends_with_separator(tokens, segment, self.ids)

    def cacheable_segments(self, tokens: Sequence[int]) -> list[Segment]:
        """The segments that may be served from and stored to the store (not the query tail)."""
        return cacheable_segments(tokens, self.ids)

    def store_units(self, tokens: Sequence[int]) -> list[Segment]:
        """The segments a computed prompt stores: its cacheable segments."""
        return self.cacheable_segments(tokens)

    def match(self, tokens: Sequence[int], held: Held) -> list[Segment]:
        """The cacheable segments ``held`` says the store holds (one batched ``held`` call)."""
        segments = self.cacheable_segments(tokens)
        if not segments:
            return []
        return [s for s, hit in zip(segments, held(segments)) if hit]

    def claim_end(self, tokens: Sequence[int], hits: Sequence[Segment]) -> int:
        """Where a blend of ``tokens`` ends: at the query tail (chunks between the last hit and
        the tail are computed by the blend, the tail by the engine)."""
        return self.query_start(tokens) if hits else 0

    def describe(self) -> str:
        """One line for the start-up log: how prompts are segmented."""
        return f"chunks end with the separator {self.text!r} (ids {list(self.ids)})"


def separator_token_ids(tokenizer: Any, blend_special_str: str) -> list[int]:
    """Token ids of the separator encoded alone, without special tokens (no BOS: ``encode(sep)
    [1:]`` would drop a real token on tokenizers that add none).

    Raises:
        ValueError: the separator encodes to no tokens.
    """
    ids = _encode(tokenizer, blend_special_str)
    if not ids:
        raise ValueError(f"blend_special_str {blend_special_str!r} encodes to no tokens")
    return ids


def separator_pattern(tokenizer: Any, blend_special_str: str) -> SeparatorPattern:
    """The ids ``blend_special_str`` produces between words, for ``tokenizer``.

    Encodes ``left + sep + right`` for a few words on each side (without special tokens, so no
    BOS), drops the left word's ids and keeps the ids common to every probe: whitespace the
    separator ends with merges into the next word and is left out.

    Raises:
        ValueError: the separator produces no ids of its own between words (e.g. whitespace only).
    """
    alone = separator_token_ids(tokenizer, blend_special_str)
    core: list[int] | None = None
    for left in _PROBE_LEFT:
        left_ids = _encode(tokenizer, left)
        for right in _PROBE_RIGHT:
            ids = _encode(tokenizer, left + blend_special_str + right)
            if ids[: len(left_ids)] != left_ids:
                continue  # the separator merged with the left word: not a usable probe
            middle = ids[len(left_ids) :]
            core = middle if core is None else _common_prefix(core, middle)
    if not core:
        raise ValueError(
            f"blend_special_str {blend_special_str!r} produces no token ids of its own between "
            f"words (alone it encodes to {alone}); choose a separator with visible characters"
        )
    return SeparatorPattern(ids=tuple(core), text=blend_special_str)


def split_segments(tokens: Sequence[int], separator: Sequence[int]) -> list[Segment]:
    """Split ``tokens`` after every occurrence of ``separator`` (occurrences do not overlap).

    Every token belongs to exactly one segment; each segment but possibly the last ends with the
    separator. An empty prompt gives no segments.
    """
    sep = list(separator)
    if not sep:
        raise ValueError("separator must hold at least one token id")
    toks = list(tokens)
    n, m = len(toks), len(sep)
    segments: list[Segment] = []
    start = i = 0
    while i + m <= n:
        if toks[i : i + m] == sep:
            segments.append(Segment(start, i + m))
            start = i = i + m
        else:
            i += 1
    if start < n:
        segments.append(Segment(start, n))
    return segments


def ends_with_separator(tokens: Sequence[int], segment: Segment, separator: Sequence[int]) -> bool:
    """Whether ``segment`` of ``tokens`` ends with ``separator``: a system part or a chunk, not
    the query tail after the last separator."""
    m = len(separator)
    return len(segment) >= m and list(tokens[segment.end - m : segment.end]) == list(separator)


def cacheable_segments(tokens: Sequence[int], separator: Sequence[int]) -> list[Segment]:
    """The segments of ``tokens`` that end with the separator.

    The tail after the last separator (the question and the assistant header) is left out: it
    is new in every real request, so it is always computed and never stored.
    """
    return [
        s for s in split_segments(tokens, separator) if ends_with_separator(tokens, s, separator)
    ]


@dataclass(frozen=True)
class BlendPrompt:
    """A prompt built by :func:`build_blend_prompt`.

    Attributes:
        token_ids: the whole prompt.
        segments: one per part: the system part, each chunk, then the question part.
        text: the prompt as text (chat template applied when one was used).
    """

    token_ids: list[int]
    segments: list[Segment]
    text: str = ""


def chat_messages(
    system: str, chunks: Sequence[str], question: str, blend_special_str: str = " # # "
) -> list[dict[str, str]]:
    """The chat messages :func:`build_blend_prompt` renders: the system message, then one user
    message ``SEP + chunk_1 + SEP + ... + chunk_n + SEP + question``.

    The user message starts with the separator so that the first chunk gets its own segment,
    tokenized exactly like the chunks after it (its first word after the separator's space).
    """
    sep = blend_special_str
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": sep + "".join(chunk + sep for chunk in chunks) + question},
    ]


def build_blend_prompt(
    tokenizer: Any,
    system: str,
    chunks: Sequence[str],
    question: str,
    blend_special_str: str = " # # ",
    use_chat_template: bool = True,
) -> BlendPrompt:
    """Token ids of ``system + SEP + chunk_1 + SEP + ... + chunk_n + SEP + question``, exactly as
    a server tokenizes that text.

    With ``use_chat_template`` and a tokenizer that has a chat template, the text is
    :func:`chat_messages` rendered by the template and encoded without special tokens (what
    vLLM's chat endpoint does; the template writes any BOS). Otherwise it is the plain string
    encoded with the tokenizer's special tokens (what vLLM's completions endpoint does).

    Because the whole text is tokenized, a chunk gets the ids it gets inside any text prompt:
    after the separator its first word carries the separator's trailing space (``' El'``, not
    ``'El'``), so the chunk's segment, and its stored entry, is the same whether the prompt came
    from this helper or from a client's text.

    Raises:
        ValueError: the prompt does not split into ``len(chunks) + 2`` segments (a chunk holds
            the separator, or the chat template trims the user message's leading separator).
    """
    pattern = separator_pattern(tokenizer, blend_special_str)
    text = None
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            chat_messages(system, chunks, question, blend_special_str),
            tokenize=False,
            add_generation_prompt=True,
        )
        token_ids = _encode(tokenizer, text)
    else:
        sep = blend_special_str
        text = system + sep + sep.join(chunks) + sep + question
        token_ids = [int(t) for t in tokenizer.encode(text)]
    segments = pattern.split(token_ids)
    if len(segments) != len(chunks) + 2:
        raise ValueError(
            f"the prompt splits into {len(segments)} segments on {blend_special_str!r}, "
            f"expected {len(chunks) + 2} (system, {len(chunks)} chunks, question): does a "
            "chunk hold the separator, or does the chat template strip the user message?"
        )
    return BlendPrompt(token_ids=token_ids, segments=segments, text=text)


#: LangChain's documented RAG system prompt (``create_stuff_documents_chain``'s example).
STOCK_RAG_SYSTEM = (
    "Use the following pieces of retrieved context to answer the question. If you don't know "
    "the answer, say that you don't know.\n\n{context}"
)


def stock_rag_prompt(
    tokenizer: Any, system: str, chunks: Sequence[str], question: str
) -> list[int]:
    """Token ids of LangChain's stock RAG chat: ``system`` then the chunks joined by blank lines
    in the system message (no separator), the question alone in the user message, rendered by
    the chat template as vLLM's chat endpoint does."""
    context = system + "\n\n" + "\n\n".join(chunks)
    messages = [
        {"role": "system", "content": STOCK_RAG_SYSTEM.format(context=context)},
        {"role": "user", "content": question},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _encode(tokenizer, text)


#: How a benchmark poses a RAG example (:func:`shaped_prompt`): ``separator`` (a chat whose user
#: message holds the separated chunks and the question), ``stock`` (LangChain's stock chat, no
#: separator) or ``text`` (the separated prompt as plain completions text ending in ``Answer:``,
#: for pretrained models that do not follow chat turns).
PROMPT_SHAPES = ("separator", "stock", "text")


def shaped_prompt(
    tokenizer: Any,
    shape: str,
    system: str,
    chunks: Sequence[str],
    question: str,
    blend_special_str: str = " # # ",
) -> list[int]:
    """Token ids of one RAG example posed in ``shape`` (one of :data:`PROMPT_SHAPES`).

    ``text`` is ``system + SEP + chunk_1 + ... + SEP + "Question: <question>\\nAnswer:"``
    encoded as vLLM's completions endpoint does (the tokenizer's BOS, no chat template); a
    question that already ends in ``Answer:`` (a template of its own, e.g. the CacheBlend
    paper's) is posed as it is.

    Raises:
        ValueError: an unknown shape (the message names it and the known ones).
    """
    if shape == "stock":
        return stock_rag_prompt(tokenizer, system, chunks, question)
    if shape == "text":
        posed = question if question.endswith("Answer:") else f"Question: {question}\nAnswer:"
        return build_blend_prompt(
            tokenizer, system, chunks, posed, blend_special_str, use_chat_template=False
        ).token_ids
    if shape == "separator":
        return build_blend_prompt(tokenizer, system, chunks, question, blend_special_str).token_ids
    raise ValueError(f"prompt shape {shape!r} is not one of {', '.join(PROMPT_SHAPES)}")
