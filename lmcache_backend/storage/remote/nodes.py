"""The Redis servers behind the shared tier, and which one holds each key.

* :class:`ServerTopology`: one server (``redis://``, ``unix://``) or the master Sentinel names
  (``redis-sentinel://``; after a failover the next connection goes to the promoted replica).
* :class:`ClusterTopology`: the primaries of a Redis Cluster (or Valkey cluster). redis-py's
  ``RedisCluster`` keeps the slot map; keys are grouped by the primary that owns their slot, and
  each primary has its own health, so a dead primary costs the keys of its slots only.

Each server is a :class:`RedisNode` with a
:class:`~lmcache_backend.storage.remote.health.ConnectionGuard` (up/down, one warning per outage,
reconnection in the background) and counters for the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lmcache_backend.logtext import shorten
from lmcache_backend.storage.remote.health import ConnectionGuard
from lmcache_backend.storage.remote.url import CLUSTER, SENTINEL, RedisTarget

logger = logging.getLogger(__name__)

#: at most one warning per node and kind of trouble in this many seconds
WARN_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Connection:
    """How every server of the tier is reached: socket timeouts and the reconnection backoff
    (seconds)."""

    timeout: float = 1.0
    connect_timeout: float = 0.25
    retry_base_delay: float = 0.5
    retry_max_delay: float = 30.0

    @property
    def delays(self) -> tuple[float, float]:
        """The reconnection backoff ``(base, max)``."""
        return (self.retry_base_delay, self.retry_max_delay)


class RedisNode:
    """One server: its client, health and counters.

    Args:
        name: ``host:port`` (a Sentinel master: ``sentinel/<master name>``), the metrics'
            ``node`` label.
        client: a redis-py client for this server alone.
        probe: raises while the server is unreachable (run by the reconnecting thread).
        connection: its reconnection backoff.
    """

    def __init__(
        self, name: str, client: Any, probe: Callable[[], object], connection: Connection
    ) -> None:
        self.name = name
        self.client = client
        self.guard = ConnectionGuard(f"redis {name}", probe, *connection.delays)
        #: values this server refused to store, and values read from it that were refused
        self.refused = 0
        self._lock = threading.Lock()
        self._warned: dict[str, float] = {}

    def count_refused(self) -> None:
        with self._lock:
            self.refused += 1

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log ``message`` at most once per :data:`WARN_INTERVAL_S` for ``kind`` (e.g. OOM)."""
        now = time.monotonic()
        with self._lock:
            last = self._warned.get(kind)
            if last is not None and now - last < WARN_INTERVAL_S:
                return
            self._warned[kind] = now
        logger.warning("redis tier %s: " + message, self.name, *args)

    def stats(self) -> dict[str, int]:
        guard = self.guard
        return {
            "up": int(guard.available),
            "outages": guard.outages,
            "reconnects": guard.reconnects,
            "refused": self.refused,
        }

    def close(self) -> None:
        self.guard.close()


def client_options(target: RedisTarget, connection: Connection) -> dict[str, Any]:
    """redis-py keyword arguments of a connection to one server of ``target``: the URL's
    credentials/TLS/db, the socket timeouts, and no client-side retries (a retry loop would
    block the request; the guard reconnects in the background instead)."""
    options = dict(target.options)
    if "path" in options:  # a Unix socket (redis-py's URL parser names it so)
        options["unix_socket_path"] = options.pop("path")
        options.pop("connection_class", None)
    options.update(
        socket_timeout=connection.timeout,
        socket_connect_timeout=connection.connect_timeout,
        health_check_interval=0,
    )
    return options


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


class ServerTopology:
    """One server, or the master a set of sentinels names.

    Args:
        target: the parsed URL (mode ``server`` or ``sentinel``).
        connection: timeouts and reconnection backoff.
        on_cluster_node: called when the server says it is a cluster node (only for a plain
            ``redis://`` URL, ``target.detect_cluster``).
    """

    def __init__(
        self,
        target: RedisTarget,
        connection: Connection,
        on_cluster_node: Callable[[], None] | None = None,
    ) -> None:
        self.target = target
        self._on_cluster_node = on_cluster_node if target.detect_cluster else None
        options = client_options(target, connection)
        self._sentinel = None
        if target.mode == SENTINEL:
            self._sentinel = redis.Sentinel(
                list(target.nodes),
                sentinel_kwargs={
                    "socket_timeout": connection.timeout,
                    "socket_connect_timeout": connection.connect_timeout,
                    "retry": _no_retry(),
                },
            )
            client = self._sentinel.master_for(target.master, retry=_no_retry(), **options)
            name = f"sentinel/{target.master}"
        else:
            if target.nodes:
                host, port = target.nodes[0]
                options.update(host=host, port=port)
                name = f"{host}:{port}"
            else:
                name = options["unix_socket_path"]
            client = redis.Redis(retry=_no_retry(), retry_on_error=[], **options)
        self.node = RedisNode(name, client, self.contact, connection)

    def contact(self) -> None:
        """Ask the server whether it is there (and, for a plain URL, whether it is a cluster
        node); raises when it cannot be reached."""
        if self._on_cluster_node is None:
            self.node.client.ping()
            return
        info = self.node.client.info("cluster")
        if int(info.get("cluster_enabled", 0)):
            self._on_cluster_node()

    def group(self, rkeys: Sequence[str]) -> list[tuple[RedisNode, list[int]]]:
        """Keys grouped by the node holding them: ``[(node, indices into rkeys)]``."""
        return [(self.node, list(range(len(rkeys))))] if rkeys else []

    def node_at(self, host: str, port: int) -> RedisNode | None:
        return None  # one server never redirects

    def node_of(self, rkey: str) -> RedisNode | None:
        return self.node

    def moved(self, exc: redis.exceptions.MovedError) -> bool:
        """A ``MOVED`` reply: this server is a cluster node; True when the tier switched to the
        cluster client (send the redirected keys again)."""
        if self._on_cluster_node is not None:
            self._on_cluster_node()
            return True
        self.node.warn(
            "moved",
            "the server answered MOVED (%s): it is a Redis Cluster node; write "
            "redis+cluster://... (or remove extra_config.remote_cluster: false)",
            shorten(str(exc), 80),
        )
        return False

    def nodes(self) -> list[RedisNode]:
        return [self.node]

    def close(self) -> None:
        self.node.close()
        for client in (self.node.client, self._sentinel):
            try:
                if client is not None:
                    client.close()
            except Exception:  # closing a broken connection may fail; nothing to do about it
                pass


class ClusterTopology:
    """The primaries of a Redis Cluster, found from seed nodes.

    Until one seed answers (at start, or while the whole cluster is unreachable) a pseudo-node
    named after the seeds stands for the cluster; its reconnecting thread builds the client.
    """

    def __init__(
        self,
        target: RedisTarget,
        connection: Connection,
    ) -> None:
        self.target = target
        self._connection = connection
        self._options = client_options(target, connection)
        self._lock = threading.Lock()
        self._nodes: dict[str, RedisNode] = {}
        self._cluster: Any = None
        self._refreshing = threading.Lock()
        self._last_refresh = 0.0
        seeds = ",".join(f"{h}:{p}" for h, p in target.nodes)
        self.seed = RedisNode(f"cluster {shorten(seeds, 120)}", None, self.connect, connection)

    def connect(self) -> None:
        """Build the cluster client: reads the slot map from the first seed that answers."""
        from redis.cluster import ClusterNode, RedisCluster

        options = {k: v for k, v in self._options.items() if k != "db"}
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.target.nodes],
            require_full_coverage=False,
            retry=_no_retry(),
            **options,
        )
        with self._lock:
            old, self._cluster = self._cluster, cluster
        if old is not None:
            old.close()

    @property
    def connected(self) -> bool:
        return self._cluster is not None

    def _node(self, cluster_node: Any) -> RedisNode:
        name = cluster_node.name
        node = self._nodes.get(name)
        if node is None:
            with self._lock:
                node = self._nodes.get(name)
                if node is None:
                    client = self._cluster.get_redis_connection(cluster_node)
                    probe = self._prober(name, client)
                    node = RedisNode(name, client, probe, self._connection)
                    self._nodes[name] = node
        return node

    def _prober(self, name: str, client: Any) -> Callable[[], object]:
        def probe() -> None:
            # a primary that stopped answering may have been replaced by a replica: re-read the
            # slot map first (any node that answers will do), so its slots go to the new owner
            self.refresh()
            client.ping()

        return probe

    def refresh(self) -> None:
        """Re-read the slot map (errors are left to the next request or probe)."""
        cluster = self._cluster
        if cluster is None:
            return
        try:
            cluster.nodes_manager.initialize()
        except Exception as exc:  # no node answered: the probes keep trying
            logger.debug("redis cluster: slot map not refreshed: %s", exc)

    def group(self, rkeys: Sequence[str]) -> list[tuple[RedisNode, list[int]]]:
        """Keys grouped by the primary owning their slot. A key whose slot no node serves
        is left out (a miss)."""
        if not rkeys:
            return []
        cluster = self._cluster
        if cluster is None:
            return [(self.seed, list(range(len(rkeys))))]
        groups: dict[str, tuple[RedisNode, list[int]]] = {}
        for i, rkey in enumerate(rkeys):
            node = self.node_of(rkey)
            if node is not None:
                groups.setdefault(node.name, (node, []))[1].append(i)
        return list(groups.values())

    def node_of(self, rkey: str) -> RedisNode | None:
        cluster = self._cluster
        if cluster is None:
            return self.seed
        try:
            owner = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(rkey))
        except redis.exceptions.SlotNotCoveredError:
            # no node serves the slot in the map this client holds (read while the cluster
            # was forming, or a slot being reassigned): a miss now, the map re-read soon
            self._refresh_soon()
            return None
        return self._node(owner)

    def _refresh_soon(self) -> None:
        """Re-read the slot map in the background, at most once per reconnection delay."""
        now = time.monotonic()
        too_soon = now - self._last_refresh < self._connection.retry_base_delay
        if too_soon or not self._refreshing.acquire(False):
            return
        self._last_refresh = now

        def run() -> None:
            try:
                self.refresh()
            finally:
                self._refreshing.release()

        threading.Thread(target=run, name="lmcache-redis-slots", daemon=True).start()

    def node_at(self, host: str, port: int) -> RedisNode | None:
        """The node at ``host:port`` (an ``ASK`` redirection's target)."""
        cluster = self._cluster
        if cluster is None:
            return None
        from redis.cluster import ClusterNode

        found = cluster.nodes_manager.get_node(host, port)
        if found is None:
            found = ClusterNode(host, port)
            found.redis_connection = cluster.nodes_manager.create_redis_node(
                host, port, **cluster.nodes_manager.connection_kwargs
            )
        return self._node(found)

    def moved(self, exc: redis.exceptions.MovedError) -> bool:
        """A ``MOVED`` reply: the slot map is stale (resharding, failover); re-read it and
        send the redirected keys again (True)."""
        self.refresh()
        return True

    def nodes(self) -> list[RedisNode]:
        """The primaries known so far (every node that owned a slot), or the seeds' stand-in."""
        if self._cluster is None:
            return [self.seed]
        cluster = self._cluster
        for primary in cluster.get_primaries():
            self._node(primary)
        return list(self._nodes.values())

    def close(self) -> None:
        self.seed.close()
        for node in list(self._nodes.values()):
            node.close()
        if self._cluster is not None:
            try:
                self._cluster.close()
            except Exception:  # closing a broken connection may fail; nothing to do about it
                pass


def topology(
    target: RedisTarget,
    connection: Connection,
    on_cluster_node: Callable[[], None] | None = None,
) -> ServerTopology | ClusterTopology:
    """The topology of ``target``'s mode."""
    if target.mode == CLUSTER:
        return ClusterTopology(target, connection)
    return ServerTopology(target, connection, on_cluster_node)
