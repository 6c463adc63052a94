"""What a storage tier adds to :class:`~lmcache_backend.storage.segments.SegmentStore`.

:class:`~lmcache_backend.storage.tiered.TieredStore` composes tiers; it needs to remove single
entries, to be told when a tier evicts one (to keep the cross-process index honest), to ask about
many keys at once, and to know whether a tier is shared with other engines.

A tier also keeps the one rule about values that fail verification (a wrong or missing
authentication tag, a damaged or truncated entry, another model's fingerprint, another length
than the segment's): such a value is never used, it is counted (:attr:`Tier.refused`) and
removed, and the next store of the segment writes the genuine value in its place (counted in
:attr:`Tier.replaced`). "The first write of a segment wins" holds only between valid values:
a refused value must not keep the segment out of the store.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from lmcache_backend.storage.segments import SegmentKV, SegmentStore

logger = logging.getLogger(__name__)

EvictListener = Callable[[str], None]

# Keys become file names and Redis keys: accept only what segment_key() produces (hex digests).
_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")
#: refused keys remembered until a genuine value replaces them (a bound, not an expectation)
_MAX_REFUSED_KEYS = 65536


def check_key(key: str) -> None:
    """Raise ``ValueError`` unless ``key`` is a lowercase hex digest (safe as a file name)."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"segment key must be a lowercase hex digest, got {key!r}")


class CopyState(enum.Enum):
    """What a shared tier's ``check_copy(key, num_tokens)`` found under a key."""

    #: the value this tier last wrote or verified (its first bytes are the same)
    SAME = "same"
    #: another value, read whole and verified (e.g. another engine's computation)
    VALID = "valid"
    #: no value
    MISSING = "missing"
    #: a value that failed verification; it was deleted
    REFUSED = "refused"
    #: the server holding the key cannot be asked now
    UNKNOWN = "unknown"


class Tier(SegmentStore):
    """A :class:`SegmentStore` that can be composed into a tiered store."""

    #: short name used in logs and stats, e.g. ``"cpu"``
    name: str = "tier"
    #: whether other engines see this tier's entries (their presence is then checked live)
    shared: bool = False

    def __init__(self) -> None:
        self._evict_listeners: list[EvictListener] = []
        #: values this tier refused since it was built (failed verification; removed)
        self.refused = 0
        #: refused values since replaced by a genuine one stored under the same key
        self.replaced = 0
        self._verdict_lock = threading.Lock()
        self._refused_keys: OrderedDict[str, None] = OrderedDict()

    def _count_refused(self, key: str) -> None:
        """``key``'s value failed verification (the caller logs why and removes it)."""
        with self._verdict_lock:
            self.refused += 1
            self._refused_keys[key] = None
            self._refused_keys.move_to_end(key)
            while len(self._refused_keys) > _MAX_REFUSED_KEYS:
                self._refused_keys.popitem(last=False)

    def _count_stored(self, key: str) -> None:
        """A value was written under ``key``: a replacement if the last one was refused."""
        with self._verdict_lock:
            if key in self._refused_keys:
                del self._refused_keys[key]
                self.replaced += 1

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
