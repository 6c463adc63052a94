"""A segment store made of tiers, fastest first: device memory, CPU memory, local disk, Redis.

* ``put`` writes through to every tier (each keeps the first entry stored under a key), so a
  tier can evict on its own without moving data down.
* ``get`` asks the tiers in order; a hit in a slower tier is copied into every faster tier. A
  value a tier refuses (it fails verification) is removed there, and the genuine value found in
  a slower tier, or computed and stored next, takes its place. After a hit in a local tier the
  shared tiers' copies are checked in the background
  (:class:`~lmcache_backend.storage.remote.shared_copy.SharedCopyCheck`).
* Each tier evicts within its own capacity, by its policy (memory tiers: LRU or S3-FIFO, and
  optionally second-sight admission; disk: LRU), see :mod:`lmcache_backend.storage.policy`.
* A :class:`~lmcache_backend.storage.lookup.index.SegmentIndex` (optional) mirrors which keys the
  local tiers hold, for a scheduler in another process (see
  :mod:`lmcache_backend.storage.lookup.index`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from lmcache_backend.storage.lookup.index import SegmentIndex
from lmcache_backend.storage.remote.shared_copy import SharedCopyCheck
from lmcache_backend.storage.segments import SegmentKV, SegmentStore
from lmcache_backend.storage.tier import Tier

logger = logging.getLogger(__name__)


class TieredStore(SegmentStore):
    """Compose ``tiers`` (fastest first) into one :class:`SegmentStore`.

    Args:
        tiers: e.g. ``[MemoryTier(cuda), MemoryTier(cpu), DiskTier(...), RedisTier(...)]``.
        index: cross-process index kept in step with the local (non-shared) tiers; it is reset
            at construction to what those tiers hold (e.g. files already on disk).

    ``get`` returns tensors ``[L, n, Hkv, D]`` on the device of the tier that hit (the
    accelerator for the device tier, otherwise the CPU), owned by the caller.
    """

    def __init__(self, tiers: Sequence[Tier], index: SegmentIndex | None = None) -> None:
        self.tiers = list(tiers)
        self.local_tiers = [t for t in self.tiers if not t.shared]
        self.remote_tiers = [t for t in self.tiers if t.shared]
        self.index = index
        self.shared_copies = SharedCopyCheck(self.remote_tiers, self._local_value)
        self._stats_lock = threading.Lock()
        self._hits = {t.name: 0 for t in self.tiers}
        self._misses = 0
        self._stored = {t.name: 0 for t in self.tiers}
        self._stored_bytes = {t.name: 0 for t in self.tiers}
        self._evicted = {t.name: 0 for t in self.tiers}
        for tier in self.tiers:
            tier.add_evict_listener(self._counter_of(tier.name))
        for tier in self.local_tiers:
            tier.add_evict_listener(self._on_evicted)
        if index is not None:
            index.clear()
            for tier in self.local_tiers:
                for key in getattr(tier, "keys", list)():
                    index.add(key)

    # -- index upkeep ------------------------------------------------------------------------

    def _counter_of(self, name: str):
        def count(key: str) -> None:
            with self._stats_lock:
                self._evicted[name] += 1

        return count

    def _on_evicted(self, key: str) -> None:
        # The marker goes only when no local tier holds the segment any more.
        if self.index is not None and not any(t.contains(key) for t in self.local_tiers):
            self.index.discard(key)

    # -- SegmentStore ------------------------------------------------------------------------

    def get(self, key: str, num_tokens: int | None = None) -> SegmentKV | None:
        for i, tier in enumerate(self.tiers):
            kv = tier.get(key, num_tokens)
            if kv is None:
                continue
            with self._stats_lock:
                self._hits[tier.name] += 1
            if i > 0:
                self._store_in(self.tiers[:i], key, kv)
            if not tier.shared:
                self.shared_copies.served_locally(key, num_tokens)
            return kv
        with self._stats_lock:
            self._misses += 1
        return None

    def put(self, key: str, kv: SegmentKV) -> bool:
        return self._store_in(self.tiers, key, kv)

    def _local_value(self, key: str, num_tokens: int | None) -> SegmentKV | None:
        """``key``'s value in the first local tier that holds it (no promotion, no counting)."""
        for tier in self.local_tiers:
            kv = tier.get(key, num_tokens)
            if kv is not None:
                return kv
        return None

    def replace(self, key: str, kv: SegmentKV) -> bool:
        """``kv`` in place of ``key``'s entry in every tier (see :meth:`Tier.replace`)."""
        for tier in self.tiers:
            try:
                tier.remove(key)
            except Exception:  # a tier must never fail the request; log and go on
                logger.exception("%s tier: remove failed", tier.name)
        return self._store_in(self.tiers, key, kv)

    def _store_in(self, tiers: Sequence[Tier], key: str, kv: SegmentKV) -> bool:
        cpu_kv: SegmentKV | None = None
        stored = stored_locally = False
        for tier in tiers:
            src = kv
            if getattr(tier, "device", None) is None or tier.device.type == "cpu":
                # Tiers that keep or serialise CPU data share one device-to-host copy.
                if cpu_kv is None:
                    cpu_kv = _on_cpu(kv)
                src = cpu_kv
            try:
                ok = tier.put(key, src)
            except Exception:  # a tier must never fail the request; log and go on
                logger.exception("%s tier: put failed", tier.name)
                ok = False
            stored |= ok
            stored_locally |= ok and not tier.shared
            if ok:
                with self._stats_lock:
                    self._stored[tier.name] += 1
                    self._stored_bytes[tier.name] += src.nbytes
        if stored_locally and self.index is not None:
            self.index.add(key)
        return stored

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether ``get`` is expected to hit; shared tiers are asked once for all the
        keys no local tier holds."""
        found = [any(t.contains(k) for t in self.local_tiers) for k in keys]
        for tier in self.remote_tiers:
            missing = [i for i, hit in enumerate(found) if not hit]
            if not missing:
                break
            answers = tier.contains_many([keys[i] for i in missing])
            for i, hit in zip(missing, answers, strict=True):
                found[i] = hit
        return found

    def clear(self) -> None:
        """Drop every entry of every tier, the shared ones included."""
        for tier in self.tiers:
            tier.clear()
        if self.index is not None:
            self.index.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the local tiers (a segment in two tiers counts twice)."""
        return sum(t.nbytes for t in self.local_tiers)

    def stats(self) -> dict:
        """Hits per tier, misses, bytes held per tier, entries (``stored``) and their bytes
        (``stored_bytes``) written to each tier, entries that left each tier (``evicted``:
        evicted, or removed as refused), the values each tier refused because they failed
        verification (``refused``: a missing or wrong authentication tag, a damaged or
        truncated entry, another model's or another length's) and those a genuine value then
        replaced (``replaced``), the new segments a tier's admission policy did not store
        (``admission_skipped``), and per server of the shared tiers
        (``remote_nodes``: ``{"host:port": {"up", "outages", "reconnects", "refused"}}``).
        Counts are since the store was built."""
        nodes = {}
        for tier in self.remote_tiers:
            nodes.update(getattr(tier, "node_stats", dict)())
        with self._stats_lock:
            return {
                "hits": dict(self._hits),
                "misses": self._misses,
                "stored": dict(self._stored),
                "stored_bytes": dict(self._stored_bytes),
                "evicted": dict(self._evicted),
                "bytes": {t.name: t.nbytes for t in self.tiers},
                "refused": {t.name: t.refused for t in self.tiers},
                "replaced": {t.name: t.replaced for t in self.tiers},
                "admission_skipped": {
                    t.name: t.admission_skipped
                    for t in self.tiers
                    if hasattr(t, "admission_skipped")
                },
                "remote_nodes": nodes,
            }

    def close(self) -> None:
        """Close connections and background threads of the tiers."""
        self.shared_copies.close()
        for tier in self.tiers:
            tier.close()


def _on_cpu(kv: SegmentKV) -> SegmentKV:
    if kv.keys.device.type == "cpu" and kv.values.device.type == "cpu":
        return kv
    return kv.with_tensors(kv.keys.to("cpu"), kv.values.to("cpu"))
