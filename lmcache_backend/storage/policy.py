"""Which segments a tier keeps: the eviction order and the admission of new segments.

A policy keeps keys and sizes only, never tensors; the tier holds the data and calls the policy
under its own lock (policies are not thread-safe on their own). The tier stays the authority on
what it holds: it asks :meth:`EvictionPolicy.victim` for the next key to drop, drops it, and
reports it to its evict listeners; an entry is therefore always either fully present or absent.

Eviction (``extra_config.cache_policy``):

* ``lru``: least recently used first.
* ``s3fifo``: S3-FIFO (Yang et al., SOSP 2023). New keys enter a small FIFO (10% of the bytes);
  one that was hit there moves to the main FIFO on its way out, the others leave and are
  remembered in a ghost list of keys. A key stored again while in the ghost list goes straight
  to the main FIFO. The main FIFO gives an entry hit since its last pass another pass (up to
  three), so one-off segments leave quickly and popular ones stay.

Admission (``extra_config.cache_admission``), consulted only when storing would evict:

* ``always``: every segment is stored.
* ``second_sight``: a segment is refused the first time (its key is remembered in a ghost list
  as large, in bytes, as the tier) and stored when it comes again while remembered. A refused
  segment is not in the store, so it is reused from its third appearance on.

See ``docs/storage.md`` (admission and eviction) for the measurements behind the defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

from lmcache_backend.settings import STORE
from lmcache_backend.settings.store_keys import ADMISSION_POLICIES, EVICTION_POLICIES

#: the store's defaults (create_store); a MemoryTier or DiskTier built directly uses LRU, always
DEFAULT_EVICTION: str = STORE["cache_policy"].default
DEFAULT_ADMISSION: str = STORE["cache_admission"].default

#: S3-FIFO's small queue, as a share of the tier's bytes
SMALL_SHARE = 0.1
#: highest hit count an S3-FIFO entry accumulates (passes it survives in the main queue)
MAX_FREQ = 3


class GhostList:
    """Recently seen keys without data, oldest dropped first once their sizes sum past
    ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(int(max_bytes), 0)
        self._keys: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    def add(self, key: str, nbytes: int) -> None:
        self.discard(key)
        self._keys[key] = nbytes
        self._bytes += nbytes
        while self._bytes > self.max_bytes and self._keys:
            _, size = self._keys.popitem(last=False)
            self._bytes -= size

    def discard(self, key: str) -> bool:
        """Forget ``key``; returns whether it was remembered."""
        size = self._keys.pop(key, None)
        if size is None:
            return False
        self._bytes -= size
        return True

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()
        self._bytes = 0


class EvictionPolicy(ABC):
    """The order in which a tier of ``max_bytes`` drops its entries."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)

    @abstractmethod
    def inserted(self, key: str, nbytes: int) -> None:
        """A new entry was stored."""

    @abstractmethod
    def touched(self, key: str) -> None:
        """An entry was hit (or stored again)."""

    @abstractmethod
    def victim(self) -> str | None:
        """The next key to evict, forgotten by the policy; ``None`` when it holds none."""

    @abstractmethod
    def removed(self, key: str) -> None:
        """An entry left the tier other than through :meth:`victim` (removal, a vanished
        file)."""

    @abstractmethod
    def keys(self) -> list[str]:
        """Held keys, roughly in eviction order (first out first)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self._order: OrderedDict[str, int] = OrderedDict()

    def inserted(self, key: str, nbytes: int) -> None:
        self._order[key] = nbytes
        self._order.move_to_end(key)

    def touched(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def victim(self) -> str | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def removed(self, key: str) -> None:
        self._order.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._order)

    def clear(self) -> None:
        self._order.clear()


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO in bytes: a small FIFO (:data:`SMALL_SHARE`), a main FIFO with reinsertion, and a
    ghost list of keys that left the small FIFO unhit (as large as the main FIFO)."""

    def __init__(self, max_bytes: int, small_share: float = SMALL_SHARE) -> None:
        super().__init__(max_bytes)
        self.small_target = int(max_bytes * small_share)
        self._small: OrderedDict[str, int] = OrderedDict()
        self._main: OrderedDict[str, int] = OrderedDict()
        self._small_bytes = 0
        self._freq: dict[str, int] = {}
        self.ghost = GhostList(self.max_bytes - self.small_target)

    def inserted(self, key: str, nbytes: int) -> None:
        self.removed(key)
        if self.ghost.discard(key):
            self._main[key] = nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes
        self._freq[key] = 0

    def touched(self, key: str) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def victim(self) -> str | None:
        while self._small or self._main:
            if self._small and (self._small_bytes >= self.small_target or not self._main):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._freq[key] > 0:  # hit while new: it earned a place in the main queue
                    self._freq[key] = 0
                    self._main[key] = size
                    continue
                del self._freq[key]
                self.ghost.add(key, size)
                return key
            key, size = self._main.popitem(last=False)
            if self._freq[key] > 0:  # hit since its last pass: one more pass
                self._freq[key] -= 1
                self._main[key] = size
                continue
            del self._freq[key]
            return key
        return None

    def removed(self, key: str) -> None:
        if self._freq.pop(key, None) is None:
            return
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
        else:
            self._main.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._small) + list(self._main)

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._small_bytes = 0
        self._freq.clear()
        self.ghost.clear()


class Admission:
    """``always``: every new segment is stored."""

    name = "always"

    def admit(self, key: str, nbytes: int) -> bool:
        """Whether a new segment that would make the tier evict is stored."""
        return True

    def clear(self) -> None:
        """Forget what was seen."""


class SecondSightAdmission(Admission):
    """``second_sight``: refuse a key the first time, store it when seen again while its key is
    still in a ghost list of ``max_bytes`` (the tier's capacity)."""

    name = "second_sight"

    def __init__(self, max_bytes: int) -> None:
        self.ghost = GhostList(max_bytes)

    def admit(self, key: str, nbytes: int) -> bool:
        if self.ghost.discard(key):
            return True
        self.ghost.add(key, nbytes)
        return False

    def clear(self) -> None:
        self.ghost.clear()


def make_eviction(name: str, max_bytes: int) -> EvictionPolicy:
    """The eviction policy called ``name`` (one of :data:`EVICTION_POLICIES`)."""
    if name == "lru":
        return LRUPolicy(max_bytes)
    if name == "s3fifo":
        return S3FIFOPolicy(max_bytes)
    raise ValueError(
        f"unknown eviction policy {name!r}: choose one of {', '.join(EVICTION_POLICIES)}"
    )


def make_admission(name: str, max_bytes: int) -> Admission:
    """The admission policy called ``name`` (one of :data:`ADMISSION_POLICIES`)."""
    if name == "always":
        return Admission()
    if name == "second_sight":
        return SecondSightAdmission(max_bytes)
    raise ValueError(
        f"unknown admission policy {name!r}: choose one of {', '.join(ADMISSION_POLICIES)}"
    )
