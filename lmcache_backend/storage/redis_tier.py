"""Redis tier: segments shared by every engine that points at the same server.

A value is the byte format of :mod:`lmcache_backend.storage.serde` stored under
``<prefix><key>`` with ``SET NX`` (the first engine to store a segment wins; later stores of the
same segment keep that value). Capacity and eviction are the server's: run it with ``maxmemory``
and ``maxmemory-policy allkeys-lru`` to get LRU eviction within a byte budget.

With a shared secret (``auth``) every value is sealed with an HMAC over its key and bytes
(:mod:`lmcache_backend.storage.auth`) and every value read must carry a valid tag: one that does
not is a miss, logged, counted (:attr:`RedisTier.rejected`) and deleted, never parsed. Without
one, anyone who can write to the server chooses the K/V other engines load.

When the server cannot be reached every operation degrades to a miss (``get``/``contains``) or a
skipped store (``put``) after at most one socket timeout; :class:`ConnectionGuard` then skips the
server without any network call and reconnects in the background.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lmcache_backend.storage.auth import AuthenticationError, EntryAuth, is_sealed
from lmcache_backend.storage.health import ConnectionGuard
from lmcache_backend.storage.segments import SegmentKV
from lmcache_backend.storage.serde import (
    CorruptEntryError,
    ExpectedLayout,
    FingerprintMismatchError,
    decode,
    encode,
)
from lmcache_backend.storage.tier import Tier, check_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PREFIX = "lmcache_backend:segment:"
# Delete a key only if it still holds the value that failed verification (compared by SHA-1, so
# the value is not sent back): a good value stored meanwhile by another engine is kept.
_DELETE_IF_SAME = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
    "return 0"
)
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisTier(Tier):
    """Segments in a Redis server at ``url`` (``redis://host:port[/db]``).

    Args:
        url: the server; ``rediss://`` for TLS.
        fingerprint: hex fingerprint digest written into and required of every entry.
        layout: expected model layout checked on load.
        prefix: namespace of the keys in the server.
        timeout: socket timeout (s) for commands; bounds how long one request can wait on a
            server that stopped answering. Large values must still fit: 1 s moves ~1 GB on a
            10 Gbit/s link.
        connect_timeout: socket timeout (s) for opening a connection.
        ttl: seconds an entry lives in the server (``None``: until the server evicts it).
        retry_base_delay, retry_max_delay: reconnection backoff (s), doubling from base to max.
        auth: seals every value written and checks every value read (the shared secret);
            ``None``: values are stored as they are, and sealed ones are not used.
    """

    name = "redis"
    shared = True

    def __init__(
        self,
        url: str,
        fingerprint: str | None = None,
        layout: ExpectedLayout | None = None,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 1.0,
        connect_timeout: float = 0.25,
        ttl: float | None = None,
        retry_base_delay: float = 0.5,
        retry_max_delay: float = 30.0,
        auth: EntryAuth | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self.auth = auth
        #: values refused because their authentication tag was missing or wrong
        self.rejected = 0
        self._rejected_lock = threading.Lock()
        self.fingerprint = fingerprint
        self.layout = layout
        self.prefix = prefix
        self.ttl_ms = int(ttl * 1000) if ttl else None
        # No client-side retries: a retry loop with backoff would block the request; the guard
        # reconnects in the background instead.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_error=[],
            health_check_interval=0,
        )
        self._delete_if_same = self._client.register_script(_DELETE_IF_SAME)
        self.guard = ConnectionGuard(
            _redact(url), self._client.ping, retry_base_delay, retry_max_delay
        )
        # Learn at start whether the server is there (one connect timeout at most).
        self._call(self._client.ping, None)

    def _rkey(self, key: str) -> str:
        check_key(key)
        return self.prefix + key

    def _call(self, fn: Callable[[], T], fallback: T) -> T:
        """Run ``fn`` unless the server is down; on a connection failure return ``fallback``."""
        if not self.guard.available:
            return fallback
        try:
            return fn()
        except _UNREACHABLE as exc:
            self.guard.failed(exc)
            return fallback
        except redis.exceptions.RedisError as exc:  # e.g. OOM under maxmemory-policy noeviction
            logger.warning("redis tier: %s: %s", type(exc).__name__, exc)
            return fallback

    @property
    def available(self) -> bool:
        """Whether the server is believed reachable."""
        return self.guard.available

    def get(self, key: str) -> SegmentKV | None:
        rkey = self._rkey(key)
        data = self._call(lambda: self._client.get(rkey), None)
        if data is None:
            return None
        entry = self._open(key, rkey, data)
        if entry is None:
            return None
        try:
            return decode(entry, key, self.fingerprint, self.layout)
        except CorruptEntryError as exc:
            logger.warning("redis tier: dropping corrupted segment %s: %s", rkey, exc)
            self._drop(key, rkey, data)
            return None
        except FingerprintMismatchError as exc:
            logger.warning("redis tier: %s not used: %s", rkey, exc)
            return None

    def _open(self, key: str, rkey: str, data: bytes) -> bytes | memoryview | None:
        """The entry inside the value ``data``, or None when it must not be used."""
        if self.auth is None:
            if is_sealed(data):  # another engine's, with a secret this one does not have
                logger.warning(
                    "redis tier: %s not used: it is authenticated with a shared secret and "
                    "this engine has none",
                    rkey,
                )
                return None
            return data
        try:
            return self.auth.open(key, data)
        except AuthenticationError as exc:
            # whoever wrote it does not hold the secret: never parsed; deleted so that this
            # engine's own computation of the segment can be stored (SET NX keeps the first)
            with self._rejected_lock:
                self.rejected += 1
            logger.warning("redis tier: refusing segment %s: %s; deleted", rkey, exc)
            self._drop(key, rkey, data)
            return None

    def _drop(self, key: str, rkey: str, data: bytes) -> None:
        """Delete ``rkey`` if it still holds ``data`` (another engine may have replaced it)."""
        sha1 = hashlib.sha1(data).hexdigest()
        self._call(lambda: self._delete_if_same(keys=[rkey], args=[sha1]), 0)
        self._notify_evicted([key])

    def put(self, key: str, kv: SegmentKV) -> bool:
        rkey = self._rkey(key)
        if not self.guard.available:
            return False
        try:
            data = encode(key, kv, self.fingerprint or "", self.layout)
        except ValueError as exc:
            logger.warning("redis tier: segment not stored: %s", exc)
            return False
        if self.auth is not None:
            data = self.auth.seal(key, data)

        def store() -> bool:
            # SET NX: the first writer wins; an existing entry counts as stored.
            self._client.set(rkey, data, nx=True, px=self.ttl_ms)
            return True

        return self._call(store, False)

    def contains(self, key: str) -> bool:
        rkey = self._rkey(key)
        return bool(self._call(lambda: self._client.exists(rkey), 0))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key, in one round trip."""
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]

        def ask() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.exists(rkey)
            return [bool(n) for n in pipe.execute()]

        return self._call(ask, [False] * len(keys))

    def remove(self, key: str) -> bool:
        rkey = self._rkey(key)
        removed = bool(self._call(lambda: self._client.delete(rkey), 0))
        if removed:
            self._notify_evicted([key])
        return removed

    def clear(self) -> None:
        """Delete every entry under this tier's prefix (entries of all engines sharing it)."""

        def drop_all() -> None:
            batch: list[bytes] = []
            for rkey in self._client.scan_iter(match=self.prefix + "*", count=500):
                batch.append(rkey)
                if len(batch) >= 500:
                    self._client.delete(*batch)
                    batch.clear()
            if batch:
                self._client.delete(*batch)

        self._call(drop_all, None)

    @property
    def nbytes(self) -> int:
        """0: the server's memory is not this process's."""
        return 0

    def close(self) -> None:
        self.guard.close()
        try:
            self._client.close()
        except Exception:  # closing a broken connection may fail; nothing to do about it
            pass


def _redact(url: str) -> str:
    """``url`` without a password, for logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
