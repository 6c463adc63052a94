"""In-memory tiers: accelerator memory (hot) and CPU memory, LRU bounded in bytes.

One class serves both: the tier owns copies of the tensors on its ``device`` (so in-place work on
a returned segment, e.g. re-rotating K, cannot alter the cache when ``copy_on_get`` is on) and
notifies the tiered store of evictions.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from lmcache_backend.storage.segments import SegmentKV
from lmcache_backend.storage.tier import Tier

logger = logging.getLogger(__name__)


class MemoryTier(Tier):
    """LRU of :class:`SegmentKV` on one ``torch.device``; a hit moves the entry to the front.

    Args:
        device: where the tensors live (``"cuda:0"``, ``"npu:0"``, ``"cpu"``).
        max_bytes: capacity; the least recently used entries are evicted to make room.
        name: name in logs (``"device"`` or ``"cpu"``).
        copy_on_get: return clones, so callers may modify the result in place. Costs one copy
            per hit; turn off only when every caller treats results as read-only.
        pin_memory: keep CPU copies in page-locked memory (faster host-to-device copies).
    """

    def __init__(
        self,
        device: torch.device | str,
        max_bytes: int,
        name: str = "memory",
        copy_on_get: bool = True,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError(f"{name} tier: max_bytes must be positive, got {max_bytes}")
        self.device = torch.device(device)
        self.max_bytes = int(max_bytes)
        self.name = name
        self.copy_on_get = copy_on_get
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self._entries: OrderedDict[str, SegmentKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _own_copy(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().to(self.device, copy=True).contiguous()
        return out.pin_memory() if self.pin_memory else out

    def get(self, key: str) -> SegmentKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is None:
                return None
            self._entries.move_to_end(key)
        if not self.copy_on_get:
            return kv
        # Entries are never modified after insertion, so cloning outside the lock is safe.
        return SegmentKV(kv.keys.clone(), kv.values.clone(), kv.start_position)

    def put(self, key: str, kv: SegmentKV) -> bool:
        if kv.nbytes > self.max_bytes:
            logger.warning(
                "%s tier: segment of %d tokens (%d bytes) exceeds its capacity of %d bytes; "
                "not stored there",
                self.name,
                kv.num_tokens,
                kv.nbytes,
                self.max_bytes,
            )
            return False
        with self._lock:
            if key in self._entries:  # first writer wins
                self._entries.move_to_end(key)
                return True
        # Copy outside the lock: a device copy may take milliseconds.
        owned = SegmentKV(self._own_copy(kv.keys), self._own_copy(kv.values), kv.start_position)
        evicted: list[str] = []
        with self._lock:
            if key in self._entries:  # another thread stored it while we copied
                self._entries.move_to_end(key)
                return True
            while self._bytes + owned.nbytes > self.max_bytes:
                old_key, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                evicted.append(old_key)
            self._entries[key] = owned
            self._bytes += owned.nbytes
        self._notify_evicted(evicted)
        return True

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def remove(self, key: str) -> bool:
        with self._lock:
            kv = self._entries.pop(key, None)
            if kv is not None:
                self._bytes -= kv.nbytes
        if kv is None:
            return False
        self._notify_evicted([key])
        return True

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
