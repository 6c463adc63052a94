"""Tiered segment storage: device memory, CPU memory, local disk and Redis.

Build the worker's store with :func:`create_store` and the scheduler's lookup with
:func:`create_lookup`; see ``docs/storage.md``. Importing this package does not import ``redis``
until a Redis tier is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_backend.storage.disk import DiskTier
from lmcache_backend.storage.lookup.index import FileSegmentIndex, SegmentIndex, SegmentLookup
from lmcache_backend.storage.lookup.index_dir import IndexDirError, default_index_dir
from lmcache_backend.storage.memory import MemoryTier
from lmcache_backend.storage.serde import (
    CorruptEntryError,
    ExpectedLayout,
    FingerprintMismatchError,
)
from lmcache_backend.storage.tier import Tier
from lmcache_backend.storage.tiered import TieredStore

if TYPE_CHECKING:
    from lmcache_backend.storage.factory import create_lookup, create_store
    from lmcache_backend.storage.remote.tier import RedisTier

__all__ = [
    "CorruptEntryError",
    "DiskTier",
    "ExpectedLayout",
    "FileSegmentIndex",
    "FingerprintMismatchError",
    "IndexDirError",
    "MemoryTier",
    "RedisTier",
    "SegmentIndex",
    "SegmentLookup",
    "Tier",
    "TieredStore",
    "create_lookup",
    "create_store",
    "default_index_dir",
]


def __getattr__(name: str):
    # redis is imported only when a Redis tier is built, so a CPU-only install without the
    # package can still use the local tiers.
    if name == "RedisTier":
        from lmcache_backend.storage.remote.tier import RedisTier

        return RedisTier
    if name in ("create_store", "create_lookup"):
        from lmcache_backend.storage import factory

        return getattr(factory, name)
    raise AttributeError(name)
