"""In-memory tiers: accelerator memory (hot) and CPU memory, bounded in bytes.

One class serves both: the tier owns copies of the tensors on its ``device`` (so in-place work on
a returned segment, e.g. re-rotating K, cannot alter the cache when ``copy_on_get`` is on) and
notifies the tiered store of evictions. Which entries it keeps is the choice of its eviction and
admission policies (:mod:`lmcache_backend.storage.policy`).
"""

from __future__ import annotations

import logging
import threading

import torch

from lmcache_backend.storage.policy import make_admission, make_eviction
from lmcache_backend.storage.segments import SegmentKV
from lmcache_backend.storage.tier import Tier

logger = logging.getLogger(__name__)


class MemoryTier(Tier):
    """:class:`SegmentKV` entries on one ``torch.device``, at most ``max_bytes`` of them.

    Args:
        device: where the tensors live (``"cuda:0"``, ``"npu:0"``, ``"cpu"``).
        max_bytes: capacity; entries chosen by ``eviction`` are evicted to make room.
        name: name in logs (``"device"`` or ``"cpu"``).
        copy_on_get: return clones, so callers may modify the result in place. Costs one copy
            per hit; turn off only when every caller treats results as read-only.
        pin_memory: keep CPU copies in page-locked memory (faster host-to-device copies).
        eviction: ``"lru"`` (least recently used first) or ``"s3fifo"``.
        admission: ``"always"``, or ``"second_sight"``: a new segment that would make the tier
            evict is stored only when it was offered before (counted in ``admission_skipped``).
    """

    def __init__(
        self,
        device: torch.device | str,
        max_bytes: int,
        name: str = "memory",
        copy_on_get: bool = True,
        pin_memory: bool = False,
        eviction: str = "lru",
        admission: str = "always",
    ) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError(f"{name} tier: max_bytes must be positive, got {max_bytes}")
        self.device = torch.device(device)
        self.max_bytes = int(max_bytes)
        self.name = name
        self.copy_on_get = copy_on_get
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self._entries: dict[str, SegmentKV] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._policy = make_eviction(eviction, self.max_bytes)
        self._admission = make_admission(admission, self.max_bytes)
        #: new segments the admission policy refused since the tier was built
        self.admission_skipped = 0

    def _own_copy(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().to(self.device, copy=True).contiguous()
        return out.pin_memory() if self.pin_memory else out

    def get(self, key: str, num_tokens: int | None = None) -> SegmentKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is None:
                return None
            wrong_length = num_tokens is not None and kv.num_tokens != num_tokens
            if wrong_length:
                self._pop(key)
            else:
                self._policy.touched(key)
        if wrong_length:  # stored by a caller that put another segment under this key
            logger.warning(
                "%s tier: refusing segment %s: %d tokens, the segment has %d; removed",
                self.name,
                key[:16],
                kv.num_tokens,
                num_tokens,
            )
            self._count_refused(key)
            self._notify_evicted([key])
            return None
        if not self.copy_on_get:
            return kv
        # Entries are never modified after insertion, so cloning outside the lock is safe.
        return kv.with_tensors(kv.keys.clone(), kv.values.clone())

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
                self._policy.touched(key)
                return True
            # Admission is asked only when the segment would make the tier evict.
            if self._bytes + kv.nbytes > self.max_bytes and not self._admission.admit(
                key, kv.nbytes
            ):
                self.admission_skipped += 1
                return False
        # Copy outside the lock: a device copy may take milliseconds.
        owned = kv.with_tensors(self._own_copy(kv.keys), self._own_copy(kv.values))
        evicted: list[str] = []
        with self._lock:
            if key in self._entries:  # another thread stored it while we copied
                self._policy.touched(key)
                return True
            while self._bytes + owned.nbytes > self.max_bytes and self._entries:
                evicted.append(self._evict_one())
            self._entries[key] = owned
            self._bytes += owned.nbytes
            self._policy.inserted(key, owned.nbytes)
        self._count_stored(key)
        self._notify_evicted(evicted)
        return True

    def _evict_one(self) -> str:
        """Drop the policy's victim (caller holds the lock; the tier holds an entry)."""
        key = self._policy.victim()
        while key is not None and key not in self._entries:  # never expected: skip it
            key = self._policy.victim()
        if key is None:  # the policy lost track: drop the oldest stored entry instead
            key = next(iter(self._entries))
            self._policy.removed(key)
        self._bytes -= self._entries.pop(key).nbytes
        return key

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def _pop(self, key: str) -> SegmentKV | None:
        """Drop ``key``'s entry (caller holds the lock)."""
        kv = self._entries.pop(key, None)
        if kv is not None:
            self._bytes -= kv.nbytes
            self._policy.removed(key)
        return kv

    def remove(self, key: str) -> bool:
        with self._lock:
            kv = self._pop(key)
        if kv is None:
            return False
        self._notify_evicted([key])
        return True

    def keys(self) -> list[str]:
        """Keys in the policy's eviction order, first out first (LRU: least recently used)."""
        with self._lock:
            return self._policy.keys()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._policy.clear()
            self._admission.clear()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
