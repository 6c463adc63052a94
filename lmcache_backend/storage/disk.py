"""Local disk tier: one safetensors file per segment, LRU by access time within a byte budget.

Files are ``<folder>/<key>.safetensors`` in the format of :mod:`lmcache_backend.storage.serde`.
A file is written to a temporary name in the same folder and moved into place with
``os.replace``, so a reader sees either no file or a complete one; a crash that leaves a partial
file behind is caught by the size and checksum checks on load. Each hit refreshes the file's
modification time, so the LRU order survives restarts (the folder is scanned at start).

One folder belongs to one engine: the tier keeps its byte accounting in memory.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import OrderedDict

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

SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_FILE_RE = re.compile(r"^([0-9a-f]{16,128})" + re.escape(SUFFIX) + "$")
# Temporary files older than this at start are leftovers of a crashed writer.
_STALE_TMP_SECONDS = 60.0


class DiskTier(Tier):
    """Segments as files in ``folder``, at most ``max_bytes`` of them (file sizes).

    Args:
        folder: directory for the files (created if missing).
        max_bytes: capacity; least recently used files are deleted to make room.
        fingerprint: hex fingerprint digest written into and required of every entry
            (``None``: written as ``""`` and not checked).
        layout: expected model layout checked on load (``None``: not checked).
    """

    name = "disk"

    def __init__(
        self,
        folder: str | os.PathLike,
        max_bytes: int,
        fingerprint: str | None = None,
        layout: ExpectedLayout | None = None,
    ) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError(f"disk tier: max_bytes must be positive, got {max_bytes}")
        self.folder = os.fspath(folder)
        self.max_bytes = int(max_bytes)
        self.fingerprint = fingerprint
        self.layout = layout
        os.makedirs(self.folder, exist_ok=True)
        self._entries: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._bytes = 0
        self._lock = threading.RLock()
        self._scan()

    # -- bookkeeping -------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key + SUFFIX)

    def _scan(self) -> None:
        """Load the LRU order (oldest modification time first) of files already present."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        with os.scandir(self.folder) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_SECONDS:
                        _unlink_quietly(entry.path)
                    continue
                m = _FILE_RE.match(entry.name)
                if m and entry.is_file():
                    found.append((st.st_mtime, m.group(1), st.st_size))
        for _, key, size in sorted(found):
            self._entries[key] = size
            self._bytes += size
        evicted = self._evict_until(self.max_bytes)
        if found:
            logger.info(
                "disk tier %s: %d segments (%d bytes) found, %d evicted to fit %d bytes",
                self.folder,
                len(found),
                self._bytes,
                len(evicted),
                self.max_bytes,
            )

    def _evict_one(self) -> str | None:
        """Delete the least recently used file (caller holds the lock)."""
        if not self._entries:
            return None
        key, size = self._entries.popitem(last=False)
        self._bytes -= size
        _unlink_quietly(self._path(key))
        return key

    def _evict_until(self, limit: int) -> list[str]:
        """Evict until at most ``limit`` bytes are used (caller holds the lock)."""
        evicted = []
        while self._bytes > limit and self._entries:
            evicted.append(self._evict_one())
        return evicted

    def _forget(self, key: str) -> bool:
        size = self._entries.pop(key, None)
        if size is None:
            return False
        self._bytes -= size
        return True

    # -- SegmentStore ------------------------------------------------------------------------

    def get(self, key: str, num_tokens: int | None = None) -> SegmentKV | None:
        check_key(key)
        with self._lock:
            if key not in self._entries:
                return None
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                inode = os.fstat(fh.fileno()).st_ino
                data = fh.read()
        except FileNotFoundError:  # deleted behind our back
            with self._lock:
                gone = self._forget(key)
            if gone:
                self._notify_evicted([key])
            return None
        except OSError as exc:
            logger.warning("disk tier: cannot read %s (%s); treated as a miss", path, exc)
            return None
        try:
            kv = decode(data, key, self.fingerprint, self.layout, num_tokens)
        except (CorruptEntryError, FingerprintMismatchError) as exc:
            # under this model's key, another model's entry is as wrong as a damaged one (the
            # key is a digest of the fingerprint): removed, so the genuine value can be stored
            logger.warning("disk tier: refusing segment file %s: %s; deleted", path, exc)
            self._count_refused(key)
            self._drop_file(key, inode)
            return None
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
        try:
            os.utime(path)  # persist the access for the LRU order after a restart
        except OSError:
            pass
        return kv

    def _drop_file(self, key: str, inode: int) -> None:
        """Delete ``key``'s file if it is still the one that was read (inode ``inode``)."""
        path = self._path(key)
        with self._lock:
            try:
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
            except OSError:
                pass
            dropped = self._forget(key)
        if dropped:
            self._notify_evicted([key])

    def put(self, key: str, kv: SegmentKV) -> bool:
        check_key(key)
        with self._lock:
            if key in self._entries:  # first writer wins
                self._entries.move_to_end(key)
                return True
        try:
            data = encode(key, kv, self.fingerprint or "", self.layout)
        except ValueError as exc:
            logger.warning("disk tier: segment not stored: %s", exc)
            return False
        if len(data) > self.max_bytes:
            logger.warning(
                "disk tier: segment of %d bytes exceeds its capacity of %d bytes; not stored",
                len(data),
                self.max_bytes,
            )
            return False
        evicted: list[str] = []
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            evicted += self._evict_until(self.max_bytes - len(data))
            stored = self._write_with_retry(key, data, evicted)
            if stored:
                self._entries[key] = len(data)
                self._bytes += len(data)
        if stored:
            self._count_stored(key)
        self._notify_evicted(evicted)
        return stored

    def _write_with_retry(self, key: str, data: bytes, evicted: list[str]) -> bool:
        """Write; on a full disk evict at least ``len(data)`` bytes and retry once."""
        for attempt in range(2):
            try:
                self._write_file(key, data)
                return True
            except OSError as exc:
                if exc.errno == errno.ENOSPC and attempt == 0:
                    before = len(evicted)
                    evicted += self._evict_until(max(self._bytes - len(data), 0))
                    if len(evicted) > before:
                        logger.warning(
                            "disk tier: disk full; evicted %d segments and retrying",
                            len(evicted) - before,
                        )
                        continue
                logger.warning("disk tier: segment not stored in %s: %s", self.folder, exc)
                return False
        return False

    def _write_file(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``key``'s file atomically (temporary file + ``os.replace``)."""
        tmp = os.path.join(self.folder, f"{_TMP_PREFIX}{key}-{os.getpid()}-{threading.get_ident()}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self._path(key))
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def remove(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            present = self._forget(key)
            _unlink_quietly(self._path(key))
        if present:
            self._notify_evicted([key])
        return present

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            for key in self._entries:
                _unlink_quietly(self._path(key))
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
