"""What the benchmark needs of a serving engine (:class:`BenchEngine`) and what one prefill
gives back (:class:`PrefillRun`); the engines are :mod:`.hf_engine` (HF transformers, in process)
and :mod:`.vllm_engine` (vLLM with the connector), chosen by name in :mod:`.engine_choice`.

An engine tokenizes prompts, fills its caches from a prompt, prefills a prompt with a strategy
(timing it from token ids to the first token) and decodes greedily from that prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lmcache_backend.bench.quality.strategies import Strategy
from lmcache_backend.blend.selectors.selection import chunk_heads


@dataclass
class PrefillRun:
    """One prefill of a prompt by one strategy.

    Attributes:
        logits: ``[vocab]`` fp32 logits of the first generated token.
        ttft_s: seconds from token ids to the first token (cache lookups included).
        recomputed_tokens: tokens computed in the last layer.
        token_layers: sum over layers of the tokens computed (``T * L`` for a full prefill).
        reused_tokens: tokens whose cached K/V was used.
        fallback_reason: why a reuse strategy computed everything, or None.
        state: what the engine needs to decode from this prefill.
        read_share: what the recomputed tokens hold of the question's reads (a preview
            selection's blend), else None.
        divergence: the blend's divergence estimate (a preview selection's blend), else None.
    """

    logits: torch.Tensor
    ttft_s: float
    recomputed_tokens: int
    token_layers: int
    reused_tokens: int = 0
    fallback_reason: str | None = None
    state: Any = None
    read_share: float | None = None
    divergence: float | None = None


@dataclass
class Answer:
    """A greedy answer: its text and its token ids (no end-of-sequence token)."""

    text: str
    token_ids: list[int]


class BenchEngine(Protocol):
    """What the runner needs from an engine."""

    name: str
    model_name: str
    num_layers: int

    def prompt_ids(self, system: str, chunks: Sequence[str], question: str) -> list[int]:
        """Token ids of a blend-ready prompt (separators between the parts)."""

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` encoded alone (no special tokens)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` encoded alone (no special tokens)."""

    def decode_ids(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``."""

    def reset(self) -> None:
        """Forget every cached segment and prompt."""

    def warm(self, token_ids: Sequence[int]) -> None:
        """Full prefill of ``token_ids``; keep its segments (and its prefix) for reuse."""

    def probe(self, token_ids: Sequence[int], probes: int) -> None:
        """A staleness probe of ``token_ids``: measure the stored segments it holds, each
        entry getting its prior after ``probes`` probes; store nothing."""

    def supports(self, strategy: Strategy) -> bool:
        """Whether this engine can run ``strategy``."""

    def prefill(
        self, strategy: Strategy, token_ids: Sequence[int], timed: bool = True
    ) -> PrefillRun:
        """Prefill ``token_ids`` with ``strategy`` without adding anything to the caches.
        ``timed=False`` marks the quality run, where an engine may spend time on extras (e.g.
        fetching the full first-token distribution)."""

    def decode(self, token_ids: Sequence[int], run: PrefillRun, max_new_tokens: int) -> Answer:
        """Greedy answer from a prefill."""

    def forced_logits(
        self, token_ids: Sequence[int], run: PrefillRun, answer_ids: Sequence[int]
    ) -> torch.Tensor:
        """``[len(answer_ids), vocab]`` fp32 logits (or log-probabilities) of each answer token
        given the prompt and the answer tokens before it, over this prefill's K/V: the answer
        teacher-forced, so one early difference does not change every later position."""

    def cache_bytes(self, strategy: Strategy) -> int | None:
        """Bytes of cached K/V that ``strategy`` draws on; None when the engine cannot tell."""

    def describe(self) -> dict[str, Any]:
        """Model, backend and threads, for the report."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = torch.nonzero(
        torch.as_tensor(a[:n]) != torch.as_tensor(b[:n]), as_tuple=False
    ).flatten()
    return int(differ[0]) if differ.numel() else n


def reusable_prefix(common: int, num_tokens: int, block_size: int) -> int:
    """Prefix tokens a prefix cache reuses: whole blocks only, and never the last prompt token
    (the first output needs its logits), as vLLM does."""
    usable = min(common, num_tokens - 1)
    return max(0, usable - usable % block_size)


def epic_recompute_mask(segments: Sequence[Any], num_tokens: int, k: int) -> torch.Tensor:
    """``[T]`` bool: the first ``k`` tokens of every chunk plus the whole question part.

    ``segments`` are the prompt's parts in order (system, chunks..., question); the system part
    sits at the same positions in every prompt, so its cached K/V is exact and is kept.
    """
    if len(segments) < 2:
        return torch.ones(num_tokens, dtype=torch.bool)
    mask = chunk_heads([(s.start, s.end - s.start) for s in segments[1:-1]], num_tokens, k)
    mask[segments[-1].start :] = True
    return mask


def oracle_recompute_mask(
    full: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    naive: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    valid: torch.Tensor,
    count: int,
) -> torch.Tensor:
    """``[T]`` bool: the ``count`` reusable tokens whose naive-reuse K/V deviate most from full
    prefill's, summed over layers.

    ``full`` and ``naive`` are ``(keys, values)``, per layer ``[T, Hkv, D]``; ``valid [T]``
    (bool) marks the reusable tokens. Each layer's squared K and V deviations are divided by
    their mean over the reusable tokens, so that every layer and both of K and V weigh alike.
    A selection rule sees neither full prefill's K/V nor every layer at once: this one is a
    bound on what choosing tokens can do at a budget, not a way to serve.
    """
    score = torch.zeros(valid.numel(), dtype=torch.float64)
    for fulls, naives in zip(full, naive):
        for a, b in zip(fulls, naives):
            deviation = (a.double() - b.double()).pow(2).sum(dim=(-1, -2)).cpu()
            score += deviation / deviation[valid].mean().clamp_min(1e-30)
    score[~valid] = float("-inf")
    mask = torch.zeros(valid.numel(), dtype=torch.bool)
    if count > 0:
        mask[torch.topk(score, min(count, int(valid.sum()))).indices] = True
    return mask
