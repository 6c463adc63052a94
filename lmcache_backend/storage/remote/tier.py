"""Redis tier: segments shared by every engine that points at the same Redis deployment.

One server, a Redis Cluster (or Valkey cluster) or a Sentinel-managed master
(:mod:`lmcache_backend.storage.remote.url` lists the URL forms). A value is the byte format of
:mod:`lmcache_backend.storage.serde` stored under ``<prefix>{<key>}`` with ``SET NX`` (the first
engine to store a segment wins; later stores of the same segment keep that value). The braces
are a cluster hash tag: a segment's key hashes by its digest alone, so the entries of one
segment under every tensor-parallel rank's prefix share a slot (one primary holds all of them or
none), while different segments spread over the primaries. Capacity and eviction are the
servers': run them with ``maxmemory`` and ``maxmemory-policy allkeys-lru``.

With a shared secret (``auth``) every value is sealed with an HMAC over its key and bytes
(:mod:`lmcache_backend.storage.remote.auth`) and every value read must carry a valid tag: one that
does not is a miss, logged, counted (:attr:`Tier.refused`) and deleted, never parsed. Without one,
anyone who can write to the servers chooses the K/V other engines load. A value that is
damaged, truncated, of another model or of another length than its segment is refused the same
way. Deleted, a refused value no longer holds the key: the next store of the segment (this
engine's own computation of it) is written there (:attr:`Tier.replaced`).

An engine that serves a segment from its own memory never reads the shared copy, so it would
never see that copy replaced by a bad value. :meth:`RedisTier.check_copy` looks: it compares
the stored value's length and first bytes (the authentication tag and the entry's header, which
holds its checksum) with those of the value this tier last wrote or verified, and reads and
verifies the whole value only when they differ (:mod:`lmcache_backend.storage.remote.shared_copy`
runs it in the background).

Failures cost misses, never errors. Keys are grouped by the server holding them (one pipelined
round trip per server); a server that cannot be reached costs its keys at most one socket
timeout, then it is skipped without any network call while its
:class:`~lmcache_backend.storage.remote.health.ConnectionGuard` reconnects in the background: in a
cluster only the dead primary's slots miss. ``MOVED`` and ``ASK`` replies are followed (the slot
map is re-read after a ``MOVED``); ``CLUSTERDOWN``/``TRYAGAIN`` are misses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import redis

from lmcache_backend.logtext import shorten
from lmcache_backend.storage.remote.auth import (
    MAGIC,
    TAG_BYTES,
    AuthenticationError,
    EntryAuth,
    is_sealed,
)
from lmcache_backend.storage.remote.commands import SKIPPED, UNREACHABLE, Command, run_commands
from lmcache_backend.storage.remote.nodes import (
    ClusterTopology,
    Connection,
    RedisNode,
    ServerTopology,
    topology,
)
from lmcache_backend.storage.remote.url import CLUSTER, RedisTarget, parse_remote_url
from lmcache_backend.storage.segments import SegmentKV
from lmcache_backend.storage.serde import (
    CorruptEntryError,
    ExpectedLayout,
    FingerprintMismatchError,
    decode,
    encode,
)
from lmcache_backend.storage.tier import CopyState, Tier, check_key

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "lmcache_backend:segment:"
# Delete a key only if it still holds the value that failed verification (compared by SHA-1, so
# the value is not sent back): a good value stored meanwhile by another engine is kept.
_DELETE_IF_SAME = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
    "return 0"
)
# A value's length and its first ARGV[1] bytes, in one round trip (0 and "" when missing).
_LENGTH_AND_HEAD = (
    "return {redis.call('STRLEN', KEYS[1]), "
    "redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)}"
)
#: keys whose value's first bytes are remembered for :meth:`RedisTier.check_copy` (a bound)
_MAX_KNOWN_HEADS = 65536


def redis_key(prefix: str, key: str) -> str:
    """The Redis key of segment ``key`` under ``prefix``: ``<prefix>{<key>}``."""
    return f"{prefix}{{{key}}}"


class RedisTier(Tier):
    """Segments in the Redis deployment ``url`` names.

    Args:
        url: a ``remote_url`` (one server, ``redis+cluster://``, ``redis-sentinel://``, ...) or
            an already parsed :class:`~lmcache_backend.storage.remote.url.RedisTarget`.
        fingerprint: hex fingerprint digest written into and required of every entry.
        layout: expected model layout checked on load.
        prefix: namespace of the keys (it must not hold braces: they would be the hash tag).
        timeout: socket timeout (s) for commands; bounds how long one request can wait on a
            server that stopped answering. Large values must still fit: 1 s moves ~1 GB on a
            10 Gbit/s link.
        connect_timeout: socket timeout (s) for opening a connection.
        ttl: seconds an entry lives (``None``: until the server evicts it).
        retry_base_delay, retry_max_delay: reconnection backoff (s), doubling from base to max.
        auth: seals every value written and checks every value read (the shared secret);
            ``None``: values are stored as they are, and sealed ones are not used.
    """

    name = "redis"
    shared = True

    def __init__(
        self,
        url: str | RedisTarget,
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
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"key prefix {shorten(prefix)!r} must not hold braces")
        self.target = url if isinstance(url, RedisTarget) else parse_remote_url(url)
        self.url = self.target.shown
        self.auth = auth
        # key -> (length, head length, sha1 of the head) of the value last written or verified
        self._heads: OrderedDict[str, tuple[int, int, bytes]] = OrderedDict()
        self._heads_lock = threading.Lock()
        self.fingerprint = fingerprint
        self.layout = layout
        self.prefix = prefix
        self.ttl_ms = int(ttl * 1000) if ttl else None
        self._connection = Connection(timeout, connect_timeout, retry_base_delay, retry_max_delay)
        self._switch_lock = threading.Lock()
        self._topology: ServerTopology | ClusterTopology = topology(
            self.target, self._connection, self._use_cluster
        )
        self._first_contact(self._topology)

    # -- topology ----------------------------------------------------------------------------

    def _first_contact(self, topo: ServerTopology | ClusterTopology) -> None:
        """Learn at start whether the deployment is there (one connect timeout at most)."""
        if isinstance(topo, ClusterTopology):
            node, contact = topo.seed, topo.connect
        else:
            node, contact = topo.node, topo.contact
        try:
            contact()
        except (*UNREACHABLE, redis.exceptions.RedisError) as exc:  # a warning, then retries
            node.guard.failed(exc)

    def _use_cluster(self) -> None:
        """The one server named by a plain ``redis://`` URL is a cluster node: serve the tier
        with the cluster client from now on (that node is the seed)."""
        with self._switch_lock:
            if isinstance(self._topology, ClusterTopology):
                return
            logger.info(
                "redis tier: %s is a Redis Cluster node; using the cluster client "
                "(redis+cluster://... says so in the URL)",
                self.target.shown,
            )
            self.target = dataclasses.replace(self.target, mode=CLUSTER, detect_cluster=False)
            cluster = ClusterTopology(self.target, self._connection)
            self._first_contact(cluster)
            old, self._topology = self._topology, cluster
        old.close()

    @property
    def mode(self) -> str:
        """``"server"``, ``"cluster"`` or ``"sentinel"``: how the tier talks to Redis now."""
        return self._topology.target.mode

    @property
    def available(self) -> bool:
        """Whether every server of the deployment is believed reachable."""
        return all(node.guard.available for node in self._topology.nodes())

    def node_stats(self) -> dict[str, dict[str, int]]:
        """Per server (``host:port``; a Sentinel master: ``sentinel/<name>``): ``up`` (1 or 0),
        ``outages``, ``reconnects`` (outages that ended), ``refused`` (values the server refused
        to store, and values read from it that were refused)."""
        return {node.name: node.stats() for node in self._topology.nodes()}

    # -- commands ----------------------------------------------------------------------------

    def _rkey(self, key: str) -> str:
        check_key(key)
        return redis_key(self.prefix, key)

    def _run(self, rkeys: Sequence[str], add: Command, fallback: Any) -> list[Any]:
        """:func:`~lmcache_backend.storage.remote.commands.run_commands` on this tier's
        servers."""
        return run_commands(lambda: self._topology, rkeys, add, fallback)

    # -- the tier ----------------------------------------------------------------------------

    def get(self, key: str, num_tokens: int | None = None) -> SegmentKV | None:
        return self._read(key, num_tokens)[0]

    def _read(self, key: str, num_tokens: int | None) -> tuple[SegmentKV | None, CopyState]:
        """The verified value of ``key`` and what was found (a refused value is deleted)."""
        rkey = self._rkey(key)
        replies = self._run([rkey], lambda p, k: p.get(k), SKIPPED)
        data = replies[0]
        if data is SKIPPED:
            return None, CopyState.UNKNOWN
        if data is None:
            return None, CopyState.MISSING
        if self.auth is None and is_sealed(data):
            # another engine's, with a secret this one does not have: valid for those engines
            logger.warning(
                "redis tier: %s not used: it is authenticated with a shared secret and this "
                "engine has none",
                rkey,
            )
            return None, CopyState.VALID
        try:
            entry = data if self.auth is None else self.auth.open(key, data)
            kv = decode(entry, key, self.fingerprint, self.layout, num_tokens)
        except (AuthenticationError, CorruptEntryError, FingerprintMismatchError) as exc:
            # never used; deleted so that this engine's own computation of the segment can be
            # stored (SET NX keeps the first value). Under this model's key, another model's
            # entry is as wrong as a damaged one: the key is a digest of the fingerprint.
            self._count_refused(key)
            node = self._topology.node_of(rkey)
            if node is not None:
                node.count_refused()
            logger.warning("redis tier: refusing segment %s: %s; deleted", rkey, exc)
            self._drop(key, rkey, data)
            return None, CopyState.REFUSED
        self._remember_head(key, data)
        return kv, CopyState.VALID

    def _drop(self, key: str, rkey: str, data: bytes) -> None:
        """Delete ``rkey`` if it still holds ``data`` (another engine may have replaced it)."""
        sha1 = hashlib.sha1(data).hexdigest()
        self._run([rkey], lambda p, k: p.eval(_DELETE_IF_SAME, 1, k, sha1), 0)
        self._forget_head(key)
        self._notify_evicted([key])

    def put(self, key: str, kv: SegmentKV) -> bool:
        rkey = self._rkey(key)
        node = self._topology.node_of(rkey)
        if node is None or not node.guard.available:
            return False
        try:
            data = encode(key, kv, self.fingerprint or "", self.layout)
        except ValueError as exc:
            logger.warning("redis tier: segment not stored: %s", exc)
            return False
        if self.auth is not None:
            data = self.auth.seal(key, data)
        # SET NX: the first writer wins; an existing entry (reply None) counts as stored.
        reply = self._run([rkey], lambda p, k: p.set(k, data, nx=True, px=self.ttl_ms), False)[0]
        if reply is True:
            self._count_stored(key)
            self._remember_head(key, data)
        return reply is not False

    # -- the shared copy of a segment served from elsewhere ------------------------------------

    def check_copy(self, key: str, num_tokens: int | None = None) -> CopyState:
        """Whether the value under ``key`` is still one this tier wrote or verified: its length
        and first bytes (the tag over every byte, or the header holding the checksum) are
        compared, one small read; when they differ, or none are remembered, the value is read
        whole and verified, a bad one deleted (:attr:`CopyState.REFUSED`). A change inside the
        entry that keeps both is left to the next engine that reads the value (it verifies
        every byte, refuses and replaces it)."""
        with self._heads_lock:
            known = self._heads.get(key)
        if known is not None:
            length, size, digest = known
            rkey = self._rkey(key)
            reply = self._run([rkey], lambda p, k: p.eval(_LENGTH_AND_HEAD, 1, k, size), SKIPPED)
            if reply[0] is SKIPPED:
                return CopyState.UNKNOWN
            now_length, head = reply[0]
            if now_length == length and hashlib.sha1(head).digest() == digest:
                return CopyState.SAME
        return self._read(key, num_tokens)[1]

    def _remember_head(self, key: str, data: bytes | memoryview) -> None:
        head = bytes(data[: _head_size(data)])
        with self._heads_lock:
            self._heads[key] = (len(data), len(head), hashlib.sha1(head).digest())
            self._heads.move_to_end(key)
            while len(self._heads) > _MAX_KNOWN_HEADS:
                self._heads.popitem(last=False)

    def _forget_head(self, key: str) -> None:
        with self._heads_lock:
            self._heads.pop(key, None)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key: one pipelined round trip per server holding some of them."""
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]
        return [bool(n) for n in self._run(rkeys, lambda p, k: p.exists(k), 0)]

    def remove(self, key: str) -> bool:
        rkey = self._rkey(key)
        removed = bool(self._run([rkey], lambda p, k: p.delete(k), 0)[0])
        if removed:
            self._notify_evicted([key])
        return removed

    def clear(self) -> None:
        """Delete every entry under this tier's prefix on every server (entries of all engines
        sharing it)."""
        for node in self._topology.nodes():
            if not node.guard.available or node.client is None:
                continue
            try:
                batch: list[bytes] = []
                for rkey in node.client.scan_iter(match=self.prefix + "*", count=500):
                    batch.append(rkey)
                    if len(batch) >= 500:
                        self._delete_each(node, batch)
                if batch:
                    self._delete_each(node, batch)
            except UNREACHABLE as exc:
                node.guard.failed(exc)
            except redis.exceptions.RedisError as exc:
                node.warn("clear", "clear failed: %s", shorten(str(exc)))

    @staticmethod
    def _delete_each(node: RedisNode, batch: list[bytes]) -> None:
        # one DEL per key: keys of different slots cannot share a command on a cluster node
        pipe = node.client.pipeline(transaction=False)
        for rkey in batch:
            pipe.delete(rkey)
        pipe.execute(raise_on_error=False)
        batch.clear()

    @property
    def nbytes(self) -> int:
        """0: the servers' memory is not this process's."""
        return 0

    def close(self) -> None:
        self._topology.close()


def _head_size(data: bytes | memoryview) -> int:
    """How many first bytes of a stored value tell it from another: up to the end of the
    entry's header, which holds the checksum of its tensors (and, before it, a sealed value's
    tag over every byte)."""
    start = len(MAGIC) + TAG_BYTES if is_sealed(data) else 0
    if len(data) < start + 8:
        return len(data)
    header = int.from_bytes(data[start : start + 8], "little")
    return min(len(data), start + 8 + header)
