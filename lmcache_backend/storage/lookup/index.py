"""Cross-process segment index: which segments does the worker's store hold?

In vLLM the scheduler decides how much of a prompt can be reused, but the K/V live in the worker
process. The worker's :class:`~lmcache_backend.storage.tiered.TieredStore` keeps a
:class:`FileSegmentIndex` up to date (a marker file per segment it holds in a local tier, created
on store, deleted when the last local tier drops the segment); the scheduler reads it through
:class:`SegmentLookup`, which also asks the shared Redis tier (one pipelined round trip) about
the keys no local tier holds.

The folder is private to its user and removed when the process that keeps it ends
(:mod:`lmcache_backend.storage.lookup.index_dir`): marker names are segment keys.

Consistency: the index is advisory. Markers are created after the entry is stored and deleted
after it is gone, so a reader may briefly see a stale "yes" (the entry was just evicted) or a
stale "no" (it is being stored). Both are safe: on a stale "yes" the worker's ``get`` misses and
the segment is recomputed, exactly as for an uncached segment; a stale "no" only forgoes reuse.
"""

from __future__ import annotations

import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence

from lmcache_backend.storage.lookup import index_dir
from lmcache_backend.storage.lookup.index_dir import default_index_dir  # noqa: F401 - its old home
from lmcache_backend.storage.tier import Tier, check_key

logger = logging.getLogger(__name__)

_MARKER_RE = re.compile(r"^[0-9a-f]{16,128}$")

#: From this many keys on, :meth:`FileSegmentIndex.contains_many` lists the folder once.
LISTING_BATCH = 64


class SegmentIndex(ABC):
    """A set of segment keys visible to other processes on this machine."""

    @abstractmethod
    def add(self, key: str) -> None:
        """Record that ``key`` is held."""

    @abstractmethod
    def discard(self, key: str) -> None:
        """Record that ``key`` is no longer held."""

    @abstractmethod
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is recorded."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key."""


class FileSegmentIndex(SegmentIndex):
    """One empty marker file per key in ``folder``.

    Creating and deleting a file are atomic and need no lock shared between processes; a lookup
    is one ``stat`` per key (microseconds on tmpfs). A failure to update a marker is logged once
    and otherwise ignored: the index is advisory.

    Args:
        folder: the folder.
        create: this process keeps the markers (the worker's store): the folder is created
            private to this user (or checked) and this process owns it, removing it when it
            ends (:mod:`~lmcache_backend.storage.lookup.index_dir`). False (the scheduler's
            lookup): the folder is only read, and a missing one holds no key.
        default_location: ``folder`` is :func:`default_index_dir`'s: its per-user parents are
            made private too, and folders left there by processes that no longer run are
            removed.

    Raises:
        IndexDirError: ``folder`` is a symlink, not a folder or another user's.
    """

    def __init__(
        self, folder: str | os.PathLike, create: bool = True, default_location: bool = False
    ) -> None:
        self.folder = os.path.abspath(os.fspath(folder))
        self.create = create
        if create:
            index_dir.prepare(self.folder, default_location)
        self._warned = False

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.folder, key)

    def _warn_once(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("segment index %s cannot be updated (%s)", self.folder, exc)

    def _create_marker(self, key: str) -> None:
        flags = os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW
        os.close(os.open(self._path(key), flags, 0o600))

    def add(self, key: str) -> None:
        try:
            self._create_marker(key)
        except FileNotFoundError:  # the folder was removed; recreate it (private) once
            try:
                index_dir.prepare(self.folder, default=False)
                self._create_marker(key)
            except (OSError, index_dir.IndexDirError) as exc:
                self._warn_once(exc)
        except OSError as exc:
            self._warn_once(exc)

    def discard(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn_once(exc)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        if len(keys) < LISTING_BATCH:
            return [os.path.exists(self._path(k)) for k in keys]
        # Many keys (separator-free lookups ask about one window per token): one listing of
        # the folder instead of a stat per key (4,000 stats took 68 ms on a loaded 2-core
        # machine; a listing costs in proportion to the markers held, bounded by the local
        # tiers' capacity).
        for key in keys:
            check_key(key)
        try:
            names = set(os.listdir(self.folder))
        except FileNotFoundError:
            return [False] * len(keys)
        return [k in names for k in keys]

    def keys(self) -> list[str]:
        """Every recorded key (unordered)."""
        try:
            return [n for n in os.listdir(self.folder) if _MARKER_RE.match(n)]
        except FileNotFoundError:
            return []

    def clear(self) -> None:
        for name in self.keys():
            try:
                os.unlink(os.path.join(self.folder, name))
            except OSError:
                pass

    def remove(self) -> bool:
        """Delete the folder if this process owns it (markers, owner record, folder); returns
        whether it is gone. Also done when the process ends."""
        return index_dir.remove(self.folder)

    def remove_if_orphaned(self, wait_s: float = 0.0) -> bool:
        """Delete the folder once the process that owns it has ended (see
        :func:`~lmcache_backend.storage.lookup.index_dir.remove_if_orphaned`)."""
        return index_dir.remove_if_orphaned(self.folder, wait_s)


class SegmentLookup:
    """Read side for the scheduler: which segments can the worker load?

    Args:
        index: the worker's local index (``None``: no local tiers are visible).
        remote: the shared tier, asked about keys the index does not hold (``None``: none).
    """

    def __init__(self, index: SegmentIndex | None, remote: Tier | None = None) -> None:
        self.index = index
        self.remote = remote
        if isinstance(index, FileSegmentIndex) and not index.create:
            # the worker keeping the folder may be SIGKILLed at shutdown (vLLM does so to a
            # worker still running after its engine stopped): remove it when this process ends
            index_dir.watch(index.folder)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a ``get`` in the worker is expected to hit (advisory, see module)."""
        keys = list(keys)
        found = self.index.contains_many(keys) if self.index is not None else [False] * len(keys)
        missing = [i for i, hit in enumerate(found) if not hit]
        if self.remote is not None and missing:
            remote_found = self.remote.contains_many([keys[i] for i in missing])
            for i, hit in zip(missing, remote_found, strict=True):
                found[i] = hit
        return found

    def close(self, wait_s: float = 0.0) -> None:
        """Close the remote tier; remove the index folder if its owner has ended (waiting up to
        ``wait_s`` for it)."""
        if self.remote is not None:
            self.remote.close()
        if isinstance(self.index, FileSegmentIndex) and not self.index.create:
            self.index.remove_if_orphaned(wait_s)
