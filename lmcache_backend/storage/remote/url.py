"""``remote_url``: which Redis deployment the shared tier talks to, and how.

The forms follow redis-py's URLs and LMCache's ``remote_url`` (``docs/storage.md``, "The shared
tier: one server, a cluster, or Sentinel")::

    redis://[user:password@]host[:port][/db][?option=value...]      one server
    rediss://...                                                    the same over TLS
    unix:///path/to/redis.sock[?db=N]                               one server, Unix socket
    redis+cluster://[user:password@]host:port[,host:port...]        Redis Cluster / Valkey cluster
        (also rediss+cluster://, redis-cluster://, a redis:// URL naming several
        nodes, ?cluster=true, or extra_config.remote_cluster: true)
    redis-sentinel://[user:password@]host:port[,host:port...][/master[/db]]    Sentinel
        (also redis+sentinel://, rediss-sentinel://)

A ``redis://`` URL naming one node that turns out to belong to a cluster is served by the
cluster client (the tier asks the server, ``INFO cluster``). Anything else is a
:class:`~lmcache_backend.config.ConfigError` naming the key and the (redacted, shortened) value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from lmcache_backend.config import ConfigError
from lmcache_backend.logtext import shorten
from lmcache_backend.settings import read_variable
from lmcache_backend.settings.parsers import FALSE_WORDS, TRUE_WORDS

SERVER, CLUSTER, SENTINEL = "server", "cluster", "sentinel"

#: scheme -> (mode, TLS); ``None`` mode: one server, or a cluster when several nodes are named
_SCHEMES: dict[str, tuple[str | None, bool]] = {
    "redis": (None, False),
    "rediss": (None, True),
    "unix": (SERVER, False),
    "redis+cluster": (CLUSTER, False),
    "redis-cluster": (CLUSTER, False),
    "rediss+cluster": (CLUSTER, True),
    "rediss-cluster": (CLUSTER, True),
    "redis+sentinel": (SENTINEL, False),
    "redis-sentinel": (SENTINEL, False),
    "rediss+sentinel": (SENTINEL, True),
    "rediss-sentinel": (SENTINEL, True),
}
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
#: LMCache's Sentinel connector reads the master's name from this variable ...
SENTINEL_MASTER_VARIABLE = "REDIS_SERVICE_NAME"
#: ... and uses this name when it is unset
DEFAULT_SENTINEL_MASTER = "redismaster"

#: URL options passed on to redis-py's connections (as redis-py's own URLs take them)
_PASSED_OPTIONS = frozenset(
    {
        "db",
        "protocol",
        "max_connections",
        "socket_keepalive",
        "client_name",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_check_hostname",
        "ssl_min_version",
    }
)
#: URL options this package sets itself, with the key that does
_OWN_OPTIONS = {
    "socket_timeout": "extra_config.remote_timeout",
    "timeout": "extra_config.remote_timeout",
    "socket_connect_timeout": "extra_config.remote_connect_timeout",
    "retry_on_timeout": "extra_config.remote_retry_base_delay (reconnection is in the background)",
    "retry_on_error": "extra_config.remote_retry_base_delay (reconnection is in the background)",
    "health_check_interval": "extra_config.remote_retry_base_delay",
}


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``remote_url``.

    Attributes:
        mode: ``"server"`` (one server), ``"cluster"`` or ``"sentinel"``.
        nodes: ``(host, port)`` of the server, the cluster's seed nodes or the sentinels
            (empty for a Unix socket).
        options: redis-py connection keyword arguments (credentials, TLS, ``db``, a Unix
            socket's ``path`` and connection class).
        master: the Sentinel master's name (Sentinel only).
        detect_cluster: a one-server ``redis://`` URL: ask the server whether it is a cluster
            node and use the cluster client if it is.
        shown: the URL without its password, shortened, for logs.
    """

    mode: str
    nodes: tuple[tuple[str, int], ...]
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    master: str | None = None
    detect_cluster: bool = False
    shown: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.options.get("ssl"))


def redact(url: str) -> str:
    """``url`` without a password, shortened, for logs."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        userinfo, _, hosts = rest.partition("@")
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        rest = f"{user}:***@{hosts}" if user else f"***@{hosts}"
        url = f"{scheme}://{rest}"
    return shorten(url)


def parse_remote_url(
    url: str,
    cluster: bool | None = None,
    sentinel_master: str | None = None,
    where: str = "argument",
    environ: Mapping[str, str] | None = None,
) -> RedisTarget:
    """Parse ``url`` (the ``remote_url`` setting, from ``where``).

    Args:
        cluster: ``extra_config.remote_cluster``: True forces the cluster client, False one
            server (no detection), None lets the URL and the server decide.
        sentinel_master: ``extra_config.remote_sentinel_master``: the master's name when a
            Sentinel URL has no path.
        environ: where ``REDIS_SERVICE_NAME`` is read (default ``os.environ``).

    Raises:
        ConfigError: the URL cannot be used; the message names ``remote_url`` and the value.
    """
    shown = redact(url) if isinstance(url, str) else repr(url)

    def fail(why: str) -> ConfigError:
        return ConfigError(f"remote_url (from {where}) = {shown!r}: {why}")

    if not isinstance(url, str) or not url.strip():
        raise fail("expected a Redis URL")
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise fail(f"not a Redis URL: the scheme must be one of {', '.join(_SCHEMES)}://")
    mode, tls = _SCHEMES[scheme.lower()]
    if any(c.isspace() for c in url):
        raise fail("holds whitespace")
    rest, _, query = rest.partition("?")
    if "#" in query or "#" in rest:
        raise fail("holds a fragment (#...)")
    options = _query_options(query, fail)
    flag = options.pop("cluster", None)
    if flag is not None and cluster is not None and flag != cluster:
        raise fail(f"?cluster={str(flag).lower()} contradicts extra_config.remote_cluster")
    cluster = flag if flag is not None else cluster
    if scheme.lower() == "unix":
        if cluster:
            raise fail("a Unix socket cannot reach a Redis Cluster (cluster nodes talk TCP)")
        return _unix_target(rest, options, fail, shown)
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts = netloc
    default_port = DEFAULT_SENTINEL_PORT if mode == SENTINEL else DEFAULT_PORT
    nodes = tuple(_host_port(h, default_port, fail) for h in hosts.split(","))
    if mode is None:
        if cluster is False and len(nodes) > 1:
            raise fail(
                "names several nodes, but extra_config.remote_cluster is false: one server "
                "has one address"
            )
        mode = CLUSTER if cluster or len(nodes) > 1 else SERVER
    elif cluster is not None and (mode == CLUSTER) != cluster:
        raise fail(f"a {mode} URL, but the cluster flag says {str(cluster).lower()}")
    master = None
    db_text = path
    if mode == SENTINEL:
        master, _, db_text = path.partition("/")
        master = unquote(master) or sentinel_master
        if master is None:
            master = read_variable(SENTINEL_MASTER_VARIABLE, environ) or DEFAULT_SENTINEL_MASTER
    elif sentinel_master is not None:
        raise fail("extra_config.remote_sentinel_master is set, but this is not a Sentinel URL")
    if db_text.strip("/"):
        if "db" in options:
            raise fail("gives the database twice (path and ?db=)")
        options["db"] = db_text.strip("/")
    # redis-py parses the credentials and options (types, TLS) from a one-node URL of the same
    # form, so they mean what they mean in redis-py
    one = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if at else ''}localhost"
    if options:
        one += "?" + urlencode(options)
    from redis.connection import parse_url

    try:
        kwargs = parse_url(one)
    except ValueError as exc:
        raise fail(str(exc)) from None
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    if tls:
        kwargs.pop("connection_class", None)
        kwargs["ssl"] = True
    if mode == CLUSTER and kwargs.get("db", 0) != 0:
        raise fail("a Redis Cluster has database 0 only")
    return RedisTarget(
        mode=mode,
        nodes=nodes,
        options=kwargs,
        master=master,
        detect_cluster=mode == SERVER and cluster is None,
        shown=shown,
    )


def _query_options(query: str, fail) -> dict[str, Any]:
    """The URL's options: known names only; ``cluster`` as a bool."""
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "cluster":
            word = value.strip().lower()
            if word not in TRUE_WORDS + FALSE_WORDS:
                raise fail(f"?cluster={shorten(value, 40)!r}: expected true or false")
            options["cluster"] = word in TRUE_WORDS
        elif name in _OWN_OPTIONS:
            raise fail(f"?{name}= is set by {_OWN_OPTIONS[name]}")
        elif name in _PASSED_OPTIONS:
            options[name] = value
        else:
            raise fail(
                f"unknown option ?{shorten(name, 40)}= (known: cluster, "
                f"{', '.join(sorted(_PASSED_OPTIONS))})"
            )
    return options


_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::([0-9]*))?$")


def _host_port(text: str, default_port: int, fail) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) -> ``(host, port)``."""
    match = _HOST_RE.match(text)
    if not match:
        what = "an empty node" if not text else f"node {shorten(text, 60)!r}"
        raise fail(f"{what} is not host[:port]")
    host, port = match.group(1).strip("[]"), match.group(2)
    if port is None or port == "":
        return host, default_port
    number = int(port)
    if not 0 < number < 65536:
        raise fail(f"node {shorten(text, 60)!r}: port {number} is not in 1..65535")
    return host, number


def _unix_target(path: str, options: dict[str, Any], fail, shown: str) -> RedisTarget:
    from redis.connection import parse_url

    try:
        kwargs = parse_url(f"unix://{path}" + (f"?{urlencode(options)}" if options else ""))
    except ValueError as exc:
        raise fail(str(exc)) from None
    if not kwargs.get("path"):
        raise fail("a unix:// URL needs the socket's path (unix:///run/redis.sock)")
    return RedisTarget(mode=SERVER, nodes=(), options=kwargs, shown=shown)
