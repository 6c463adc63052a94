"""What a layer loop derives from the same tensors in every layer, derived once.

A blend's layer loop hands the same objects to every layer of a pass: the active rows, their
positions. Whatever is computed from them alone (the slots of those rows, their rotary table, the
masks of their attention) gives the same answer in every layer; computing it there costs kernel
launches and, where the answer has a data-dependent size or is read back to the host, a wait for
the device. :class:`TensorMemo` keeps such a value for as long as the very same tensor objects
come back.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

V = TypeVar("V")


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a == b


class TensorMemo(Generic[V]):
    """A few values, each derived from a key of tensors (matched by identity) and plain values
    (matched by equality).

    The key's tensors must not change in place while they are keys (the blend replaces its
    active rows, it never edits them; inference-mode tensors keep no version counter to check).
    Holding them keeps them alive, so an identity is never reused by another tensor while its
    entry lasts. ``size`` entries are kept, the most recently used first (a pass usually
    alternates between two keys, e.g. every row and the active rows).
    """

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._entries: list[tuple[tuple, V]] = []

    def get(self, key: tuple[torch.Tensor | Hashable, ...], build: Callable[[], V]) -> V:
        """The value of ``key``: kept from an earlier call, else ``build()`` (and kept)."""
        for i, (held, value) in enumerate(self._entries):
            if len(held) == len(key) and all(_same(a, b) for a, b in zip(held, key)):
                if i:
                    self._entries.insert(0, self._entries.pop(i))
                return value
        value = build()
        self._entries.insert(0, (key, value))
        del self._entries[self.size :]
        return value

    def clear(self) -> None:
        """Forget every entry (e.g. when a request ends: its tensors may be freed)."""
        self._entries.clear()
