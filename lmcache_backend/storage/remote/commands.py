"""Commands to the servers of the shared tier, each key sent to the server that holds it.

Keys are grouped by server (one pipelined round trip each); ``MOVED`` and ``ASK`` replies are
followed (the slot map is re-read after a ``MOVED``); a server that cannot be reached, is busy
(``CLUSTERDOWN``/``TRYAGAIN``) or refuses a command costs its keys the caller's fallback reply,
never an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from lmcache_backend.logtext import shorten
from lmcache_backend.storage.remote.nodes import ClusterTopology, RedisNode, ServerTopology

#: what a server that cannot be reached raises
UNREACHABLE = (
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
Topology = ServerTopology | ClusterTopology


class _Skipped:
    """The reply of a command that was not sent (its server is down)."""


#: the reply of a command that was not sent
SKIPPED = _Skipped()


def run_commands(
    current: Callable[[], Topology], rkeys: Sequence[str], add: Command, fallback: Any
) -> list[Any]:
    """``add`` each key's command to a pipeline of the server holding it; the replies, in
    order. A key whose server is down, busy or refused the command gets ``fallback``
    (a refusal is counted and logged: :func:`_refused`). ``current()`` is the topology
    now (a tier may switch to the cluster client between redirections)."""
    out = [fallback] * len(rkeys)
    todo: list[tuple[int, RedisNode | None]] = [(i, None) for i in range(len(rkeys))]
    for _ in range(_MAX_REDIRECTS + 1):
        if not todo:
            break
        topo = current()
        routed: dict[str, tuple[RedisNode, list[tuple[int, bool]]]] = {}
        asked = [(i, node) for i, node in todo if node is not None]
        plain = [i for i, node in todo if node is None]
        for node, idx in topo.group([rkeys[i] for i in plain]):
            routed.setdefault(node.name, (node, []))[1].extend((plain[j], False) for j in idx)
        for i, node in asked:
            routed.setdefault(node.name, (node, []))[1].append((i, True))
        todo, moved = [], None
        for node, items in routed.values():
            for (i, _asking), reply in zip(items, _send(node, rkeys, items, add)):
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
                    _refused(node, reply)
                elif reply is not SKIPPED:
                    out[i] = reply
        if moved is not None and not topo.moved(moved):  # the slot map, re-read once
            todo = [(i, node) for i, node in todo if node is not None]
    return out


def _send(
    node: RedisNode, rkeys: Sequence[str], items: list[tuple[int, bool]], add: Command
) -> list[Any]:
    """One pipelined round trip to ``node``; a reply per item (:class:`_Skipped` when the
    server is down)."""
    skipped = [SKIPPED] * len(items)
    if not node.guard.available or node.client is None:
        return skipped
    try:
        pipe = node.client.pipeline(transaction=False)
        for i, asking in items:
            if asking:
                pipe.execute_command("ASKING")
            add(pipe, rkeys[i])
        replies = pipe.execute(raise_on_error=False)
    except UNREACHABLE as exc:
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


def _refused(node: RedisNode, reply: Exception) -> None:
    """The server refused a command (``OOM`` under ``maxmemory-policy noeviction``,
    ``READONLY``, ``NOPERM``, ...): a miss or a skipped store, counted and logged."""
    node.count_refused()
    kind = type(reply).__name__
    node.warn(kind, "refused a command (%s: %s)", kind, shorten(str(reply)))
