"""Authenticated entries of the shared tier: an HMAC over the key and the bytes.

The checksum inside an entry (:mod:`lmcache_backend.storage.serde`) catches corruption, not a
writer: anyone who can write to the Redis server can store a well-formed entry with the right
checksum and have other engines load K/V of their choosing. With a shared secret
(``extra_config.shared_secret`` or ``shared_secret_file``) every value written to the shared tier
is sealed::

    MAGIC | HMAC-SHA256(secret, MAGIC | key | "\\n" | entry) | entry

and every value read must carry a valid tag for the key it was read under; anything else
(no tag, a wrong tag, an entry moved to another key) is refused before the entry is parsed.
"""

from __future__ import annotations

import hashlib
import hmac

from lmcache_backend.settings.store_keys import MIN_SECRET_BYTES  # 128 bits

#: Leads every sealed value; names the scheme so that it can change later.
MAGIC = b"lmcache_backend.hmac-sha256.v1\n"
TAG_BYTES = hashlib.sha256().digest_size


class AuthenticationError(ValueError):
    """A value read from the shared tier is not authenticated with this engine's secret."""


class EntryAuth:
    """Seals and opens values with one secret.

    Args:
        secret: the shared secret, at least :data:`MIN_SECRET_BYTES` bytes.
    """

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the shared secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = bytes(secret)

    def __repr__(self) -> str:  # never the secret
        return "EntryAuth(<secret>)"

    def _tag(self, key: str, entry: bytes | memoryview) -> bytes:
        mac = hmac.new(self._secret, MAGIC, hashlib.sha256)
        mac.update(key.encode("ascii") + b"\n")
        mac.update(entry)
        return mac.digest()

    def seal(self, key: str, entry: bytes) -> bytes:
        """The value to store for ``entry`` under ``key``."""
        return MAGIC + self._tag(key, entry) + entry

    def open(self, key: str, value: bytes) -> memoryview:
        """The entry inside ``value`` read under ``key``.

        Raises:
            AuthenticationError: ``value`` has no tag, or its tag is not this secret's for
                ``key`` and these bytes.
        """
        view = memoryview(value)
        if not is_sealed(value):
            raise AuthenticationError("no authentication tag (written without a shared secret)")
        start = len(MAGIC)
        tag, entry = view[start : start + TAG_BYTES], view[start + TAG_BYTES :]
        if not hmac.compare_digest(tag, self._tag(key, entry)):
            raise AuthenticationError("wrong authentication tag")
        return entry


def is_sealed(value: bytes | memoryview) -> bool:
    """Whether ``value`` is a sealed entry (with a tag, valid or not)."""
    return len(value) >= len(MAGIC) + TAG_BYTES and value[: len(MAGIC)] == MAGIC
