"""How a prompt is cut into cached units, as configured: around a separator, in fixed-size blocks
found at any offset, or each prompt by what it holds (``blend_segmentation``).

* ``separator`` (LMCache's behaviour): a chunk ends with ``blend_special_str``
  (:class:`~lmcache_backend.blend.segmenting.SeparatorPattern`); a prompt without it reuses
  nothing.
* ``blocks``: no separator needed (:class:`BlockPattern`): a computed prompt stores its tokens as
  blocks of ``blend_block_size`` tokens, and a new prompt finds them wherever they occur — in the
  system message, in any user message, next to the question.
* ``auto`` (the default): a prompt holding the separator is cut around it, any other prompt in
  blocks, so applications that mark their chunks keep whole-chunk reuse and stock applications
  (LangChain, LlamaIndex: documents joined by blank lines) are reused too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_backend.blend.segmenting import Held, Segment, SeparatorPattern, separator_pattern
from lmcache_backend.settings import SEGMENTATION_CHOICES as SEGMENTATIONS


@dataclass(frozen=True)
class BlockPattern:
    """Separator-free segmenting: fixed-size token blocks, found wherever they recur.

    A computed prompt stores its tokens as blocks of ``block_size`` tokens aligned to the start
    of the prompt (``[0, B)``, ``[B, 2B)``, ...), each with the position it was computed at. A new
    prompt is searched for those blocks at *every* token offset (one key per window of ``B``
    tokens, one batched lookup); a found block's K/V are reused (re-rotated to the new positions
    by the blender), every token not covered by a found block is computed like an uncached
    token. A chunk that moved by any number of tokens is found, except its edges: up to
    ``B - 1`` tokens at each end fall in blocks that also hold neighbouring text.

    The last token is never stored nor served (it gives the first output token). A blend ends
    at the end of the last block found (:meth:`claim_end`): the question, and whatever follows
    the last reused block, is computed fresh by the engine.

    Attributes:
        block_size: ``B``, tokens per block (``blend_block_size``).
    """

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def query_start(self, tokens: Sequence[int]) -> int:
        """Tokens from here on are never stored nor served: the last one."""
        return max(0, len(tokens) - 1)

    def split(self, tokens: Sequence[int]) -> list[Segment]:
        """The aligned blocks, then the rest of the prompt as one segment (every token belongs
        to exactly one segment)."""
        units = self.store_units(tokens)
        end = units[-1].end if units else 0
        return units + ([Segment(end, len(tokens))] if end < len(tokens) else [])

    def store_units(self, tokens: Sequence[int]) -> list[Segment]:
        """The blocks a computed prompt stores: aligned to its start, before its last token."""
        b, q = self.block_size, self.query_start(tokens)
        return [Segment(i, i + b) for i in range(0, q - b + 1, b)]

    def match(self, tokens: Sequence[int], held: Held) -> list[Segment]:
        """Stored blocks found in ``tokens`` at any offset before the last token, left to right,
        not overlapping (a hit at ``i`` resumes the search at ``i + B``)."""
        b, q = self.block_size, self.query_start(tokens)
        windows = [Segment(i, i + b) for i in range(0, q - b + 1)]
        if not windows:
            return []
        hits = held(windows)
        found, i = [], 0
        while i < len(windows):
            if hits[i]:
                found.append(windows[i])
                i += b
            else:
                i += 1
        return found

    def claim_end(self, tokens: Sequence[int], hits: Sequence[Segment]) -> int:
        """Where a blend of ``tokens`` ends: after the last block found (0: none)."""
        return max((h.end for h in hits), default=0)

    def describe(self) -> str:
        return f"blocks of {self.block_size} tokens, found at any offset (no separator needed)"


@dataclass(frozen=True)
class AutoPattern:
    """Each prompt by what it holds: around ``separator`` when the prompt holds it, else in
    ``blocks``. A prompt's units are stored the same way, so a prompt sent with separators
    reuses chunks stored by prompts with separators, and blocks those stored without."""

    separator: SeparatorPattern
    blocks: BlockPattern

    def for_prompt(self, tokens: Sequence[int]) -> SeparatorPattern | BlockPattern:
        """The pattern ``tokens`` is cut with."""
        ids, m = list(self.separator.ids), len(self.separator.ids)
        toks = list(tokens)
        first = ids[0]
        for i, t in enumerate(toks[: len(toks) - m + 1]):
            if t == first and toks[i : i + m] == ids:
                return self.separator
        return self.blocks

    def query_start(self, tokens: Sequence[int]) -> int:
        return self.for_prompt(tokens).query_start(tokens)

    def split(self, tokens: Sequence[int]) -> list[Segment]:
        return self.for_prompt(tokens).split(tokens)

    def store_units(self, tokens: Sequence[int]) -> list[Segment]:
        return self.for_prompt(tokens).store_units(tokens)

    def match(self, tokens: Sequence[int], held: Held) -> list[Segment]:
        return self.for_prompt(tokens).match(tokens, held)

    def claim_end(self, tokens: Sequence[int], hits: Sequence[Segment]) -> int:
        return self.for_prompt(tokens).claim_end(tokens, hits)

    def describe(self) -> str:
        return (
            f"a prompt holding {self.separator.text!r} is cut after each occurrence; any other "
            f"prompt in {self.blocks.describe()}"
        )


#: How a prompt splits into cached units.
SegmentPattern = SeparatorPattern | BlockPattern | AutoPattern


def segment_pattern(
    tokenizer: Any, blend_special_str: str, block_size: int = 16, segmentation: str = "auto"
) -> SegmentPattern:
    """The pattern a configuration asks for (see the module docstring); an empty
    ``blend_special_str`` always means blocks.

    Raises:
        ValueError: ``segmentation`` is unknown, or the separator produces no ids of its own.
    """
    if segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation {segmentation!r}: choose one of {', '.join(SEGMENTATIONS)}")
    blocks = BlockPattern(block_size=block_size)
    if blend_special_str == "" or segmentation == "blocks":
        return blocks
    separator = separator_pattern(tokenizer, blend_special_str)
    return separator if segmentation == "separator" else AutoPattern(separator, blocks)


def as_pattern(separator: Any) -> SegmentPattern:
    """``separator`` as a pattern: a pattern is returned as is, token ids become a
    :class:`SeparatorPattern` matching exactly those ids."""
    if hasattr(separator, "match") and hasattr(separator, "store_units"):
        return separator
    ids = separator.tolist() if hasattr(separator, "tolist") else list(separator)
    return SeparatorPattern(ids=tuple(int(t) for t in ids))
