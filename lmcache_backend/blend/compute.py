"""What a blend computes with: the model adapter, the op set and how scores agree across ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmcache_backend.models.base import ModelAdapter
from lmcache_backend.ops import Ops

#: ``[N]`` token scores -> ``[N]`` scores every tensor-parallel rank agrees on (e.g. their sum)
ScoreReducer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlendCompute:
    """The model adapter and kernels of one blender, shared by every request it blends.

    Attributes:
        model: the model seen layer by layer (:class:`~lmcache_backend.models.base.ModelAdapter`).
        ops: the op set (:func:`lmcache_backend.ops.get_ops`).
        score_reducer: applied to the ``[N]`` token scores before choosing, e.g. a sum over
            tensor-parallel ranks so every rank keeps the same tokens; None: scores as they are.
    """

    model: ModelAdapter
    ops: Ops
    score_reducer: ScoreReducer | None = None

    def agreed(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` as every rank sees them (unchanged without a reducer)."""
        return scores if self.score_reducer is None else self.score_reducer(scores)
