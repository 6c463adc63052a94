"""The store's ``extra_config`` settings, parsed and checked once.

``extra_config`` is LMCache's free-form mapping; the store's keys in it are declared in the
settings registry (:mod:`lmcache_backend.settings.store_keys`). Each is checked here, so that a bad
value fails with a :class:`~lmcache_backend.config.ConfigError` naming ``extra_config.<key>``,
where it came from and the value (a secret is never printed), instead of a traceback from deep
inside a tier. Other keys are left alone (they may be LMCache's own); one that looks like a
misspelt store key is logged with the key it resembles.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_backend.config import BlendConfig, ConfigError
from lmcache_backend.settings import STORE, parse_given, setting_field, with_defaults
from lmcache_backend.settings.environment import FORCE_LMCACHE_EXTRA_KEY
from lmcache_backend.settings.registry import closest
from lmcache_backend.settings.store_keys import MIN_SECRET_BYTES
from lmcache_backend.storage.remote.url import RedisTarget, parse_remote_url

logger = logging.getLogger(__name__)

#: A secret file is small; anything larger is the wrong file.
MAX_SECRET_FILE_BYTES = 4096

SECRET_KEYS = ("shared_secret", "shared_secret_file")
#: ``extra_config`` settings of the store, with their defaults.
EXTRA_DEFAULTS: dict[str, Any] = with_defaults(STORE, {})


@dataclass(frozen=True)
class StoreSettings:
    """The store's ``extra_config`` settings, checked: one field per store key of the registry
    (generated from it by ``lmcache-backend config --docs``), the secrets replaced by
    ``secret``, the shared secret's bytes (from ``shared_secret`` or the file named by
    ``shared_secret_file``), or None; ``remote`` is ``remote_url`` parsed with
    ``remote_cluster`` and ``remote_sentinel_master`` (None without a ``remote_url``)."""

    # <settings-fields: dataclass store except shared_secret,shared_secret_file>
    #: accelerator-memory tier capacity, GB; 0 turns it off
    max_local_device_size: float = setting_field(STORE["max_local_device_size"])
    #: which entries the memory tiers evict first
    cache_policy: str = setting_field(STORE["cache_policy"])
    #: which new segments a full memory tier stores
    cache_admission: str = setting_field(STORE["cache_admission"])
    #: memory tiers return copies, so callers may change results in place
    copy_on_get: bool = setting_field(STORE["copy_on_get"])
    #: keep the cross-process index (marker files)
    segment_index: bool = setting_field(STORE["segment_index"])
    #: folder of the index; private to its user
    segment_index_dir: str | None = setting_field(STORE["segment_index_dir"])
    #: namespace of the keys in Redis
    remote_key_prefix: str | None = setting_field(STORE["remote_key_prefix"])
    #: `remote_url` is a Redis Cluster (`true`) or one server (`false`)
    remote_cluster: bool | None = setting_field(STORE["remote_cluster"])
    #: the Sentinel master's name, for a `redis-sentinel://` URL without a `/<name>` path
    remote_sentinel_master: str | None = setting_field(STORE["remote_sentinel_master"])
    #: socket timeout of one Redis command, s (must fit the largest value on your network)
    remote_timeout: float = setting_field(STORE["remote_timeout"])
    #: socket timeout of opening a connection, s
    remote_connect_timeout: float = setting_field(STORE["remote_connect_timeout"])
    #: expiry of Redis entries, s; null (or 0): until the server evicts them
    remote_ttl: float | None = setting_field(STORE["remote_ttl"])
    #: s before the first reconnection attempt
    remote_retry_base_delay: float = setting_field(STORE["remote_retry_base_delay"])
    #: cap of the doubling reconnection delay, s
    remote_retry_max_delay: float = setting_field(STORE["remote_retry_max_delay"])
    # </settings-fields>
    secret: bytes | None = field(default=None, repr=False)
    remote: RedisTarget | None = None


def store_settings(config: BlendConfig) -> StoreSettings:
    """Parse and check the store's ``extra_config`` keys of ``config`` (reads the secret file).

    Raises:
        ConfigError: a value is invalid; the message names ``extra_config.<key>``, where it
            came from and the value (never a secret's).
    """
    extra = config.extra_config
    where = config.sources.get("extra_config", "argument")
    _warn_misspelt(extra, where)
    values = with_defaults(STORE, parse_given(STORE, extra, where))

    def fail(key: str, why: str) -> ConfigError:
        return STORE[key].error(extra[key], where, why)

    base, most = values["remote_retry_base_delay"], values["remote_retry_max_delay"]
    if most < base:  # name the one the user gave (both, if both: the cap)
        if "remote_retry_max_delay" in extra:
            raise fail("remote_retry_max_delay", f"must be >= remote_retry_base_delay ({base})")
        raise fail("remote_retry_base_delay", f"must be <= remote_retry_max_delay ({most})")
    secret, secret_file = values.pop("shared_secret"), values.pop("shared_secret_file")
    if secret is not None and secret_file is not None:
        raise fail("shared_secret_file", "give shared_secret or this, not both")
    raw: bytes | None = None
    if secret is not None:
        raw = secret.encode("utf-8", "surrogatepass")
        if len(raw.strip()) < MIN_SECRET_BYTES:
            raise fail("shared_secret", f"must be at least {MIN_SECRET_BYTES} bytes")
    elif secret_file is not None:
        raw = _read_secret_file(secret_file, lambda why: fail("shared_secret_file", why))
    if raw is not None and not config.remote_url:
        key = SECRET_KEYS[secret is None]
        logger.warning("extra_config.%s has no effect without remote_url", key)
    remote = None
    if config.remote_url:
        remote = parse_remote_url(
            config.remote_url,
            cluster=values["remote_cluster"],
            sentinel_master=values["remote_sentinel_master"],
            where=config.sources.get("remote_url", "argument"),
        )
    return StoreSettings(**values, secret=raw, remote=remote)


def _warn_misspelt(extra: dict, where: str) -> None:
    """Log the keys of ``extra`` that are not the store's but look like one of its keys (other
    keys belong to LMCache and pass quietly)."""
    for key in extra:
        if key in STORE or key == FORCE_LMCACHE_EXTRA_KEY or not isinstance(key, str):
            continue
        close = closest(key, STORE, cutoff=0.85)
        if close is not None:
            logger.warning(
                "extra_config key %r (from %s) is not one of the store's; did you mean %r?",
                key,
                where,
                close,
            )


def _read_secret_file(path: str, fail: Callable[[str], ConfigError]) -> bytes:
    """The secret in ``path``: its bytes without surrounding whitespace (a trailing newline)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise fail(f"cannot open it ({exc.strerror})") from None
    except ValueError:  # a character the file system's encoding cannot hold
        raise fail("cannot open it (not a valid path here)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fail("not a regular file")
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise fail(f"{st.st_size} bytes: a secret file holds at most {MAX_SECRET_FILE_BYTES}")
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1).strip()
    except OSError as exc:
        raise fail(f"cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) < MIN_SECRET_BYTES:
        raise fail(f"holds {len(data)} bytes; the secret must be at least {MIN_SECRET_BYTES}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        logger.warning(
            "extra_config.shared_secret_file %s can be read by other users (mode %o): chmod 600",
            path,
            stat.S_IMODE(st.st_mode),
        )
    return data
