"""Split prompts into segments on the separator's token ids, and build blend-ready prompts.

Segments follow LMCache's "special token" (SPT) convention: a chunk ends with the separator, so
``[x, x, x, S, y, y, S, z, z]`` (``S`` the separator's ids) gives ``[x, x, x, S]``, ``[y, y, S]``
and ``[z, z]``. The separator is encoded *without* special tokens: ``encode(sep)[1:]`` would drop
a real token on tokenizers that add no BOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_PLACEHOLDER = "\x00LMCACHE_BACKEND_USER_CONTENT\x00"


@dataclass(frozen=True)
class Segment:
    """Tokens ``start`` (inclusive) to ``end`` (exclusive) of a prompt."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def separator_token_ids(tokenizer: Any, blend_special_str: str) -> list[int]:
    """Token ids of the separator, encoded without special tokens.

    Raises:
        ValueError: the separator encodes to no tokens.
    """
    ids = list(tokenizer.encode(blend_special_str, add_special_tokens=False))
    if not ids:
        raise ValueError(f"blend_special_str {blend_special_str!r} encodes to no tokens")
    return ids


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
    """

    token_ids: list[int]
    segments: list[Segment]


def _chat_frame(tokenizer: Any, system: str) -> tuple[str, str] | None:
    """Text before and after the user content in the tokenizer's chat template, if it has one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": _PLACEHOLDER},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(_PLACEHOLDER) != 1:
        return None
    head, tail = text.split(_PLACEHOLDER)
    return head, tail


def build_blend_prompt(
    tokenizer: Any,
    system: str,
    chunks: Sequence[str],
    question: str,
    blend_special_str: str = " # # ",
    use_chat_template: bool = True,
) -> BlendPrompt:
    """Token ids of ``system + SEP + chunk_1 + SEP + ... + chunk_n + SEP + question``.

    Each part is tokenized on its own, so a chunk has the same ids in every prompt that holds it
    (tokenizing the joined string could merge tokens across a boundary). The tokenizer's BOS, if it
    adds one, appears only at the very start. With ``use_chat_template`` and a tokenizer that has
    a chat template, the system part carries the template's opening (system turn, start of the user
    turn) and the question part its closing (end of user turn, assistant header).
    """
    sep = separator_token_ids(tokenizer, blend_special_str)
    frame = _chat_frame(tokenizer, system) if use_chat_template else None
    head, tail = frame if frame else (system, "")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    bos = getattr(tokenizer, "bos_token_id", None)
    first = encode(head)
    # Add the BOS a plain ``encode`` would add, unless the chat template already wrote it.
    adds_bos = bos is not None and list(tokenizer.encode("x"))[:1] == [bos]
    if adds_bos and first[:1] != [bos]:
        first = [bos] + first
    parts = [first + sep] + [encode(chunk) + sep for chunk in chunks]
    parts.append(encode(question + tail))
    token_ids: list[int] = []
    segments: list[Segment] = []
    for part in parts:
        segments.append(Segment(len(token_ids), len(token_ids) + len(part)))
        token_ids.extend(part)
    return BlendPrompt(token_ids=token_ids, segments=segments)
