"""Keeps the shared tier's copy of a segment genuine while an engine serves it from its memory.

An engine that holds a segment in a local tier never reads the shared tier's copy of it, so it
would never notice that copy overwritten by a value that fails verification (written without
the shared secret, damaged, truncated): the other engines of the fleet would refuse it, delete
it and compute the segment again, each of them, until one stores it back. So after a local hit
the tiered store hands the key to :class:`SharedCopyCheck`, which asks each shared tier in the
background (:meth:`~lmcache_backend.storage.remote.tier.RedisTier.check_copy`: one small read of
the value's first bytes while it is the value the tier wrote or verified) and, where the copy
was refused, stores the local value in its place.

A key is checked at most once per :data:`CHECK_INTERVAL_S`; keys wait in a bounded queue, and a
key that finds the queue full is checked at a later hit. A missing copy is left missing: the
servers evicted it, and writing it back would fight their eviction.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from lmcache_backend.storage.segments import SegmentKV
from lmcache_backend.storage.tier import CopyState, Tier

logger = logging.getLogger(__name__)

#: seconds between two checks of one key's shared copy
CHECK_INTERVAL_S = 60.0
#: keys waiting for their check at most
MAX_PENDING = 256
#: keys whose last check time is remembered at most (a bound, not an expectation)
_MAX_REMEMBERED = 65536

#: ``local_value(key, num_tokens)``: the segment as a local tier holds it, or None
LocalValue = Callable[[str, int | None], SegmentKV | None]


class SharedCopyCheck:
    """Checks, in a background thread, the shared tiers' copies of segments served locally.

    Args:
        tiers: the shared tiers; each has ``check_copy(key, num_tokens)`` and ``put``.
        local_value: reads the segment back from a local tier when a copy must be replaced
            (the queue holds keys, not tensors).
        interval_s: seconds between two checks of one key.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        local_value: LocalValue,
        interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.tiers = [t for t in tiers if hasattr(t, "check_copy")]
        self.local_value = local_value
        self.interval_s = interval_s
        self._checked_at: OrderedDict[str, float] = OrderedDict()
        self._pending: queue.Queue[tuple[str, int | None] | None] = queue.Queue(MAX_PENDING)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def served_locally(self, key: str, num_tokens: int | None) -> None:
        """``key`` was served from a local tier: check its shared copies if it is time."""
        if not self.tiers or self._closed:
            return
        now = time.monotonic()
        with self._lock:
            last = self._checked_at.get(key)
            if last is not None and now - last < self.interval_s:
                return
            try:
                self._pending.put_nowait((key, num_tokens))
            except queue.Full:  # checked at a later hit
                return
            self._checked_at[key] = now
            self._checked_at.move_to_end(key)
            while len(self._checked_at) > _MAX_REMEMBERED:
                self._checked_at.popitem(last=False)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lmcache-backend-shared-copy", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._pending.get()
            try:
                if job is None:
                    return
                self._check(*job)
            except Exception:  # a check must never end the thread
                logger.exception("shared copy check of %s failed", job[0][:16] if job else "")
            finally:
                self._pending.task_done()

    def _check(self, key: str, num_tokens: int | None) -> None:
        for tier in self.tiers:
            if tier.check_copy(key, num_tokens) is not CopyState.REFUSED:
                continue
            kv = self.local_value(key, num_tokens)
            if kv is None:  # evicted locally meanwhile: the next computation stores it
                continue
            if tier.put(key, kv):
                logger.info("%s tier: refused copy of segment %s replaced", tier.name, key[:16])

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued check ran (for tests and shutdown); whether they did."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the thread after the queued checks."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            try:
                self._pending.put(None, timeout=5.0)
            except queue.Full:
                return
            thread.join(timeout=10.0)
