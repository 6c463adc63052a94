"""What a storage tier adds to :class:`~lmcache_backend.storage.segments.SegmentStore`.

:class:`~lmcache_backend.storage.tiered.TieredStore` composes tiers; it needs to remove single
entries, to be told when a tier evicts one (to keep the cross-process index honest), to ask about
many keys at once, and to know whether a tier is shared with other engines.
"""

from __future__ import annotations

import logging
import re
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence

from lmcache_backend.storage.segments import SegmentKV, SegmentStore

logger = logging.getLogger(__name__)

EvictListener = Callable[[str], None]

# Keys become file names and Redis keys: accept only what segment_key() produces (hex digests).
_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")


def check_key(key: str) -> None:
    """Raise ``ValueError`` unless ``key`` is a lowercase hex digest (safe as a file name)."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"segment key must be a lowercase hex digest, got {key!r}")


class Tier(SegmentStore):
    """A :class:`SegmentStore` that can be composed into a tiered store."""

    #: short name used in logs and stats, e.g. ``"cpu"``
    name: str = "tier"
    #: whether other engines see this tier's entries (their presence is then checked live)
    shared: bool = False

    def __init__(self) -> None:
        self._evict_listeners: list[EvictListener] = []

    def add_evict_listener(self, listener: EvictListener) -> None:
        """Call ``listener(key)`` after an entry leaves this tier (eviction or removal).

        Listeners run outside the tier's lock, so they may call back into any tier.
        """
        self._evict_listeners.append(listener)

    def _notify_evicted(self, keys: Iterable[str]) -> None:
        for key in keys:
            for listener in self._evict_listeners:
                try:
                    listener(key)
                except Exception:  # a listener bug must not break storing
                    logger.exception("evict listener failed for %s", key)

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Drop ``key``; returns whether it was present."""

    def replace(self, key: str, kv: SegmentKV) -> bool:
        """The entry of ``key`` removed, then ``kv`` stored (another engine may read a miss in
        between, never a mix of the two)."""
        self.remove(key)
        return self.put(key, kv)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``[contains(k) for k in keys]``; remote tiers answer in one round trip."""
        return [self.contains(k) for k in keys]

    def close(self) -> None:
        """Release connections and background threads (no-op for local tiers)."""
