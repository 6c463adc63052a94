"""What makes cached K/V of one model unusable by another: :class:`ModelFingerprint`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes cached K/V of one model unusable by another.

    ``weights_digest`` is a hash of a few weight rows, so two fine-tunes of the same architecture
    do not share entries. The backend is deliberately absent: every backend computes the same K/V.
    """

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: str  # e.g. "theta=100000.0,neox=True,scaling=None"
    dtype: str
    weights_digest: str

    def digest(self) -> bytes:
        text = "|".join(f"{k}={v}" for k, v in sorted(self.__dict__.items()))
        return hashlib.sha256(text.encode()).digest()
