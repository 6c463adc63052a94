"""The store's ``extra_config`` settings, parsed and checked once.

``extra_config`` is LMCache's free-form mapping; the keys below are the store's. Each is checked
here, so that a bad value fails with a :class:`~lmcache_backend.config.ConfigError` naming the key,
where it came from and the value (a secret is never printed), instead of a traceback from deep
inside a tier. Other keys are left alone (they may be LMCache's own).
"""

from __future__ import annotations

import logging
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_backend.config import BlendConfig, ConfigError
from lmcache_backend.storage.auth import MIN_SECRET_BYTES
from lmcache_backend.storage.policy import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION,
    DEFAULT_EVICTION,
    EVICTION_POLICIES,
)

logger = logging.getLogger(__name__)

#: A secret file is small; anything larger is the wrong file.
MAX_SECRET_FILE_BYTES = 4096


def _number(minimum: float, inclusive: bool, unit: str) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number {unit}")
        number = float(value)
        ok = number >= minimum if inclusive else number > minimum
        if not (math.isfinite(number) and ok):
            raise ValueError(f"expected a finite number {'>=' if inclusive else '>'} {minimum}")
        return number

    return parse


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse_optional(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null")):
            return None
        return parse(value)

    return parse_optional


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    """One of ``choices``, case-insensitive (LMCache writes ``LRU``)."""

    def parse(value: Any) -> str:
        text = value.strip().lower() if isinstance(value, str) else None
        if text not in choices:
            raise ValueError(f"choose one of {', '.join(choices)}")
        return text

    return parse


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise ValueError("expected a non-empty string")
    return value


#: key -> (parser, default); the parsers raise ValueError/TypeError with the reason
_KEYS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    # accelerator-memory tier in GB; 0 turns it off (vLLM's KV cache needs that memory)
    "max_local_device_size": (_number(0.0, True, "(GB)"), 0.0),
    # keep the cross-process index (marker files) for the scheduler
    "segment_index": (_flag, True),
    # folder of the index; default /dev/shm/lmcache_backend-<uid>/index/<instance_id>
    "segment_index_dir": (_optional(_text), None),
    # which entries the memory tiers evict first, and which new ones they store when full
    "cache_policy": (_choice(EVICTION_POLICIES), DEFAULT_EVICTION),
    "cache_admission": (_choice(ADMISSION_POLICIES), DEFAULT_ADMISSION),
    # return copies from memory tiers so callers may work on results in place
    "copy_on_get": (_flag, True),
    # namespace of the keys in Redis; None: "lmcache_backend:segment:"
    "remote_key_prefix": (_optional(_text), None),
    "remote_timeout": (_number(0.0, False, "(s)"), 1.0),  # per command
    "remote_connect_timeout": (_number(0.0, False, "(s)"), 0.25),  # per connection attempt
    # None (or 0): until the server evicts them
    "remote_ttl": (_optional(_number(0.0, True, "(s)")), None),
    "remote_retry_base_delay": (_number(0.0, False, "(s)"), 0.5),
    "remote_retry_max_delay": (_number(0.0, False, "(s)"), 30.0),
    # authenticates every entry of the shared tier (storage/auth.py); never printed
    "shared_secret": (_optional(_text), None),
    "shared_secret_file": (_optional(_text), None),
}

#: ``extra_config`` settings of the store, with their defaults.
EXTRA_DEFAULTS: dict[str, Any] = {name: default for name, (_, default) in _KEYS.items()}

SECRET_KEYS = ("shared_secret", "shared_secret_file")


@dataclass(frozen=True)
class StoreSettings:
    """The store's ``extra_config`` settings, checked (see :data:`EXTRA_DEFAULTS`).

    ``secret`` holds the shared secret's bytes (from ``shared_secret`` or the file named by
    ``shared_secret_file``), or None.
    """

    max_local_device_size: float = 0.0
    segment_index: bool = True
    segment_index_dir: str | None = None
    cache_policy: str = DEFAULT_EVICTION
    cache_admission: str = DEFAULT_ADMISSION
    copy_on_get: bool = True
    remote_key_prefix: str | None = None
    remote_timeout: float = 1.0
    remote_connect_timeout: float = 0.25
    remote_ttl: float | None = None
    remote_retry_base_delay: float = 0.5
    remote_retry_max_delay: float = 30.0
    secret: bytes | None = field(default=None, repr=False)


def _shown(key: str, value: Any) -> str:
    if key == "shared_secret":
        size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else None
        return "<hidden>" if size is None else f"<hidden, {size} bytes>"
    return repr(value)


def store_settings(config: BlendConfig) -> StoreSettings:
    """Parse and check the store's ``extra_config`` keys of ``config`` (reads the secret file).

    Raises:
        ConfigError: a value is invalid; the message names ``extra_config.<key>``, where it
            came from and the value (never a secret's).
    """
    extra = config.extra_config
    where = config.sources.get("extra_config", "argument")

    def fail(key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"extra_config.{key} (from {where}) = {_shown(key, value)}: {why}")

    values: dict[str, Any] = {}
    for key, (parse, default) in _KEYS.items():
        if key not in extra:
            values[key] = default
            continue
        try:
            values[key] = parse(extra[key])
        except (TypeError, ValueError, OverflowError) as exc:
            raise fail(key, extra[key], str(exc) or type(exc).__name__) from None
    base, most = values["remote_retry_base_delay"], values["remote_retry_max_delay"]
    if most < base:  # name the one the user gave (both, if both: the cap)
        if "remote_retry_max_delay" in extra:
            why = f"must be >= remote_retry_base_delay ({base})"
            raise fail("remote_retry_max_delay", extra["remote_retry_max_delay"], why)
        why = f"must be <= remote_retry_max_delay ({most})"
        raise fail("remote_retry_base_delay", extra["remote_retry_base_delay"], why)
    secret, secret_file = values.pop("shared_secret"), values.pop("shared_secret_file")
    if secret is not None and secret_file is not None:
        raise fail("shared_secret_file", secret_file, "give shared_secret or this, not both")
    raw: bytes | None = None
    if secret is not None:
        raw = secret.encode("utf-8", "surrogatepass")
        if len(raw.strip()) < MIN_SECRET_BYTES:
            raise fail("shared_secret", secret, f"must be at least {MIN_SECRET_BYTES} bytes")
    elif secret_file is not None:
        raw = _read_secret_file(
            secret_file, lambda why: fail("shared_secret_file", secret_file, why)
        )
    if raw is not None and not config.remote_url:
        key = SECRET_KEYS[secret is None]
        logger.warning("extra_config.%s has no effect without remote_url", key)
    return StoreSettings(**values, secret=raw)


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
