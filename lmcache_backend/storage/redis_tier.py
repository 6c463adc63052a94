"""Redis tier: segments shared by every engine that points at the same Redis deployment.

One server, a Redis Cluster (or Valkey cluster) or a Sentinel-managed master
(:mod:`lmcache_backend.storage.redis_url` lists the URL forms). A value is the byte format of
:mod:`lmcache_backend.storage.serde` stored under ``<prefix>{<key>}`` with ``SET NX`` (the first
engine to store a segment wins; later stores of the same segment keep that value). The braces
are a cluster hash tag: a segment's key hashes by its digest alone, so the entries of one
segment under every tensor-parallel rank's prefix share a slot (one primary holds all of them or
none), while different segments spread over the primaries. Capacity and eviction are the
servers': run them with ``maxmemory`` and ``maxmemory-policy allkeys-lru``.

With a shared secret (``auth``) every value is sealed with an HMAC over its key and bytes
(:mod:`lmcache_backend.storage.auth`) and every value read must carry a valid tag: one that does
not is a miss, logged, counted (:attr:`RedisTier.rejected`) and deleted, never parsed. Without
one, anyone who can write to the servers chooses the K/V other engines load.

Failures cost misses, never errors. Keys are grouped by the server holding them (one pipelined
round trip per server); a server that cannot be reached costs its keys at most one socket
timeout, then it is skipped without any network call while its
:class:`~lmcache_backend.storage.health.ConnectionGuard` reconnects in the background: in a
cluster only the dead primary's slots miss. ``MOVED`` and ``ASK`` replies are followed (the slot
map is re-read after a ``MOVED``); ``CLUSTERDOWN``/``TRYAGAIN`` are misses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis

from lmcache_backend.logtext import shorten
from lmcache_backend.storage.auth import AuthenticationError, EntryAuth, is_sealed
from lmcache_backend.storage.redis_nodes import (
    ClusterTopology,
    Connection,
    RedisNode,
    ServerTopology,
    topology,
)
from lmcache_backend.storage.redis_url import CLUSTER, RedisTarget, parse_remote_url
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

DEFAULT_PREFIX = "lmcache_backend:segment:"
# Delete a key only if it still holds the value that failed verification (compared by SHA-1, so
# the value is not sent back): a good value stored meanwhile by another engine is kept.
_DELETE_IF_SAME = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
    "return 0"
)
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.RedisClusterException,  # no seed node answered
    OSError,
)
#: redirections followed for one key (a MOVED after a resharding, then an ASK while migrating)
_MAX_REDIRECTS = 2
_BUSY = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)

#: ``add(pipeline, redis key)`` queues one command for one key
Command = Callable[[Any, str], object]


def redis_key(prefix: str, key: str) -> str:
    """The Redis key of segment ``key`` under ``prefix``: ``<prefix>{<key>}``."""
    return f"{prefix}{{{key}}}"


class RedisTier(Tier):
    """Segments in the Redis deployment ``url`` names.

    Args:
        url: a ``remote_url`` (one server, ``redis+cluster://``, ``redis-sentinel://``, ...) or
            an already parsed :class:`~lmcache_backend.storage.redis_url.RedisTarget`.
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
        #: values refused because their authentication tag was missing or wrong
        self.rejected = 0
        self._rejected_lock = threading.Lock()
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
        except (*_UNREACHABLE, redis.exceptions.RedisError) as exc:  # a warning, then retries
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
        """``add`` each key's command to a pipeline of the server holding it; the replies, in
        order. A key whose server is down, busy or refused the command gets ``fallback``
        (a refusal is counted and logged: :meth:`_refused`)."""
        out = [fallback] * len(rkeys)
        todo: list[tuple[int, RedisNode | None]] = [(i, None) for i in range(len(rkeys))]
        for _ in range(_MAX_REDIRECTS + 1):
            if not todo:
                break
            topo = self._topology
            routed: dict[str, tuple[RedisNode, list[tuple[int, bool]]]] = {}
            asked = [(i, node) for i, node in todo if node is not None]
            plain = [i for i, node in todo if node is None]
            for node, idx in topo.group([rkeys[i] for i in plain]):
                routed.setdefault(node.name, (node, []))[1].extend((plain[j], False) for j in idx)
            for i, node in asked:
                routed.setdefault(node.name, (node, []))[1].append((i, True))
            todo, moved = [], None
            for node, items in routed.values():
                for (i, _asking), reply in zip(items, self._send(node, rkeys, items, add)):
                    if isinstance(reply, redis.exceptions.MovedError):
                        moved = reply
                        todo.append((i, None))
                    elif isinstance(reply, redis.exceptions.AskError):
                        target = topo.node_at(reply.host, reply.port)
                        if target is not None:
                            todo.append((i, target))
                    elif isinstance(reply, _BUSY):
                        node.warn("busy", "%s: keys on it miss", shorten(str(reply), 100))
                    elif isinstance(reply, redis.exceptions.ResponseError):
                        self._refused(node, reply)
                    elif not isinstance(reply, _Skipped):
                        out[i] = reply
            if moved is not None and not topo.moved(moved):  # the slot map, re-read once
                todo = [(i, node) for i, node in todo if node is not None]
        return out

    def _send(
        self, node: RedisNode, rkeys: Sequence[str], items: list[tuple[int, bool]], add: Command
    ) -> list[Any]:
        """One pipelined round trip to ``node``; a reply per item (:class:`_Skipped` when the
        server is down)."""
        skipped = [_SKIPPED] * len(items)
        if not node.guard.available or node.client is None:
            return skipped
        try:
            pipe = node.client.pipeline(transaction=False)
            for i, asking in items:
                if asking:
                    pipe.execute_command("ASKING")
                add(pipe, rkeys[i])
            replies = pipe.execute(raise_on_error=False)
        except _UNREACHABLE as exc:
            node.guard.failed(exc)
            return skipped
        except redis.exceptions.RedisError as exc:  # e.g. NOAUTH on connect
            node.warn("error", "%s: %s", type(exc).__name__, shorten(str(exc)))
            return skipped
        if any(asking for _, asking in items):  # drop the ASKING replies
            kept, replies = [], iter(replies)
            for _, asking in items:
                if asking:
                    next(replies)
                kept.append(next(replies))
            return kept
        return replies

    def _refused(self, node: RedisNode, reply: Exception) -> None:
        """The server refused a command (``OOM`` under ``maxmemory-policy noeviction``,
        ``READONLY``, ``NOPERM``, ...): a miss or a skipped store, counted and logged."""
        node.count_refused()
        kind = type(reply).__name__
        node.warn(kind, "refused a command (%s: %s)", kind, shorten(str(reply)))

    # -- the tier ----------------------------------------------------------------------------

    def get(self, key: str) -> SegmentKV | None:
        rkey = self._rkey(key)
        data = self._run([rkey], lambda p, k: p.get(k), None)[0]
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
            node = self._topology.node_of(rkey)
            if node is not None:
                node.count_refused()
            logger.warning("redis tier: refusing segment %s: %s; deleted", rkey, exc)
            self._drop(key, rkey, data)
            return None

    def _drop(self, key: str, rkey: str, data: bytes) -> None:
        """Delete ``rkey`` if it still holds ``data`` (another engine may have replaced it)."""
        sha1 = hashlib.sha1(data).hexdigest()
        self._run([rkey], lambda p, k: p.eval(_DELETE_IF_SAME, 1, k, sha1), 0)
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
        return reply is not False

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
            except _UNREACHABLE as exc:
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


class _Skipped:
    """The reply of a command that was not sent (its server is down)."""


_SKIPPED = _Skipped()
