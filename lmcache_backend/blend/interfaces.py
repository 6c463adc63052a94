"""LMCache's blend interfaces, under their LMCache names (``lmcache.blend.interfaces``).

Shapes: ``T`` tokens of the request(s), ``N`` selected tokens, ``hidden_dims = H * D``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class BlendOutput:
    """The short Q, the long blended K/V and the positions of the selected queries.

    Attributes:
        q: ``[N, hidden_dims]`` queries of the selected tokens.
        k, v: ``[T, hidden_dims]`` blended keys/values of every token.
        positions: ``[N]`` positions of the selected tokens in the input sequence.
        local_indices: ``[N]`` indices of the selected tokens within the fresh q passed in.
        query_start_loc: ``[B + 1]`` request boundaries after selection, or None when no
            selection happened at this layer.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    local_indices: torch.Tensor
    query_start_loc: torch.Tensor | None


@dataclass
class BlendRetrieverResult:
    """One layer of retrieved K/V for the tokens of a request.

    Attributes:
        k, v: ``[T, Hkv * D]``, or None when nothing was retrieved; rows where ``valid_mask`` is
            False hold zeros.
        valid_mask: ``[T]`` bool on the CPU: True where the row came from the cache.
        original_positions: ``[T]`` int64 positions the cached rows were computed at (0 where
            invalid), on the device of ``k``.
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    valid_mask: torch.Tensor
    original_positions: torch.Tensor


class BlendRetrieverTask(ABC):
    """A retrieval started by :meth:`BlendRetriever.new_request`."""

    @abstractmethod
    def result(self, layer_id: int) -> BlendRetrieverResult:
        """Blocking: the K/V of ``layer_id`` for all tokens passed to ``new_request``."""


class BlendRetriever(ABC):
    """Finds the cached K/V of a request's tokens."""

    @abstractmethod
    def new_request(
        self, input_tokens: torch.Tensor, query_start_loc: torch.Tensor
    ) -> BlendRetrieverTask:
        """Start retrieving for ``input_tokens [T]`` holding requests split at
        ``query_start_loc [B + 1]``."""


class BlendExecutor(ABC):
    """Blends retrieved K/V with fresh K/V, layer by layer."""

    @abstractmethod
    def blend(
        self,
        layer_id: int,
        retrieved_k: torch.Tensor,
        retrieved_v: torch.Tensor,
        valid_mask: torch.Tensor,
        original_positions: torch.Tensor,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_dim: int,
    ) -> BlendOutput:
        """Return the short Q, long blended K/V and the positions of the tokens in Q."""
