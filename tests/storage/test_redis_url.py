"""``remote_url`` forms (redis-py's and LMCache's) and the one-line errors of unusable ones."""

from __future__ import annotations

import pytest

from lmcache_backend.config import ConfigError, load_config
from lmcache_backend.storage import create_store
from lmcache_backend.storage.remote.url import parse_remote_url
from lmcache_backend.storage.settings import store_settings


def _target(url: str, **extra):
    return store_settings(load_config(env={}, remote_url=url, extra_config=extra)).remote


@pytest.mark.parametrize(
    ("url", "mode", "nodes"),
    [
        ("redis://h1", "server", [("h1", 6379)]),
        ("redis://h1:7000/2", "server", [("h1", 7000)]),
        ("rediss://user:pw@h1:7000", "server", [("h1", 7000)]),
        ("redis://[::1]:7000", "server", [("::1", 7000)]),
        ("redis://h1:7000,h2:7001,h3", "cluster", [("h1", 7000), ("h2", 7001), ("h3", 6379)]),
        ("redis://h1:7000?cluster=true", "cluster", [("h1", 7000)]),
        ("redis+cluster://h1:7000,h2:7001", "cluster", [("h1", 7000), ("h2", 7001)]),
        ("redis-cluster://h1:7000", "cluster", [("h1", 7000)]),  # LMCache's
        ("rediss+cluster://h1:7000", "cluster", [("h1", 7000)]),
        ("redis-sentinel://h1:26379,h1:26380", "sentinel", [("h1", 26379), ("h1", 26380)]),
        ("redis+sentinel://h1,h2/mymaster/3", "sentinel", [("h1", 26379), ("h2", 26379)]),
    ],
)
def test_url_forms(url, mode, nodes):
    target = _target(url)
    assert target.mode == mode and list(target.nodes) == nodes


def test_what_each_form_carries():
    one = _target("rediss://user:p%40ss@h1:7000/2?ssl_cert_reqs=none")
    assert one.options["username"] == "user" and one.options["password"] == "p@ss"
    assert one.options["db"] == 2 and one.tls and one.options["ssl_cert_reqs"] == "none"
    assert one.detect_cluster  # a plain redis:// URL: the server is asked
    assert "p@ss" not in one.shown and "p%40ss" not in one.shown
    assert not _target("redis://h1", remote_cluster=False).detect_cluster
    assert _target("redis://h1", remote_cluster=True).mode == "cluster"  # LMCache-style flag
    assert _target("redis+sentinel://h1/name/3").master == "name"
    assert _target("redis+sentinel://h1/name/3").options["db"] == 3
    assert _target("redis-sentinel://h1", remote_sentinel_master="m2").master == "m2"
    env = {"REDIS_SERVICE_NAME": "from-env"}
    assert parse_remote_url("redis-sentinel://h1", environ=env).master == "from-env"
    assert parse_remote_url("redis-sentinel://h1", environ={}).master == "redismaster"
    sock = _target("unix:///run/redis.sock?db=1")
    assert sock.mode == "server" and sock.options["path"] == "/run/redis.sock"


@pytest.mark.parametrize(
    ("url", "extra", "why"),
    [
        ("lm://localhost:65432", {}, "not a Redis URL"),
        ("redis://h1:99999", {}, "not in 1..65535"),
        ("redis://h1:port", {}, "is not host[:port]"),
        ("redis://h1,,h2", {}, "an empty node"),
        ("redis://", {}, "an empty node"),
        ("redis+cluster://h1:7000/3", {}, "database 0 only"),
        ("redis://h1,h2", {"remote_cluster": False}, "one server has one address"),
        ("redis+sentinel://h1", {"remote_cluster": True}, "cluster flag"),
        ("redis://h1?cluster=maybe", {}, "expected true or false"),
        ("redis://h1?cluster=true", {"remote_cluster": False}, "contradicts"),
        ("redis://h1?socket_timeout=3", {}, "extra_config.remote_timeout"),
        ("redis://h1?colour=blue", {}, "unknown option ?colour="),
        ("redis://h1?db=x", {}, "Invalid value for 'db'"),
        ("redis://h1/2?db=3", {}, "database twice"),
        ("redis://h1", {"remote_sentinel_master": "m"}, "not a Sentinel URL"),
        ("unix://", {}, "the socket's path"),
        ("unix:///s.sock", {"remote_cluster": True}, "Unix socket"),
    ],
)
def test_unusable_urls_fail_in_one_line_naming_key_and_value(url, extra, why):
    with pytest.raises(ConfigError) as err:
        _target(url, **extra)
    message = str(err.value)
    assert why in message and "\n" not in message
    assert message.startswith("remote_url (from argument) = ")
    assert url.split("?")[0][:20] in message


def test_a_bad_url_stops_the_store_instead_of_running_without_the_shared_tier():
    config = load_config(env={}, remote_url="redis+cluster://h1:7000/3")
    with pytest.raises(ConfigError, match="remote_url"):
        create_store(config)


def test_messages_hide_the_password_and_stay_short():
    with pytest.raises(ConfigError) as err:
        _target("redis://admin:hunter2@h1:7000,h2:bad")
    assert "hunter2" not in str(err.value) and "admin:***@" in str(err.value)
    huge = "redis://" + ",".join(f"h{i}:1" for i in range(50_000)) + ",bad:x"
    with pytest.raises(ConfigError) as err:
        _target(huge)
    assert len(str(err.value)) < 500
    env = load_config(env={"LMCACHE_REMOTE_URL": "mooncakestore://x"})
    with pytest.raises(ConfigError, match=r"remote_url \(from LMCACHE_REMOTE_URL\)"):
        store_settings(env)


def test_key_prefix_must_not_hold_a_hash_tag():
    config = load_config(
        env={}, remote_url="redis://h1", extra_config={"remote_key_prefix": "app:{x}:"}
    )
    with pytest.raises(ConfigError, match=r"extra_config.remote_key_prefix .* must not hold"):
        store_settings(config)
