"""Shared-memory segments an engine killed with SIGKILL leaves in ``/dev/shm``.

vLLM's processes talk through ``multiprocessing.shared_memory`` segments (``/dev/shm/psm_*``,
hundreds of MB each, sparse). A normal shutdown unlinks them; after a SIGKILL of the whole
engine nothing does, and a crash loop (a supervisor restarting a server that keeps being
killed) would fill ``/dev/shm`` one engine's segments at a time. The worker that owns an index
folder (:mod:`lmcache_backend.storage.lookup.index_dir`) records the segments it maps next to its
owner record; whoever removes the folder of an owner that no longer runs (the next start, or the
server process) unlinks those segments too — only ours, only ``psm_*`` names, and only while no
running process maps them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: the record's file name in the index folder
RECORD_FILE = ".lmcache_backend_shm"
# multiprocessing.shared_memory's names (what vLLM's message queues use); nothing else is touched
_SEGMENT_RE = re.compile(r"^psm_[0-9a-f]{8,64}$")
#: segments recorded at most (a bound on what a record can make us look at)
_MAX_RECORDED = 64


def mapped_segments(maps_path: str = "/proc/self/maps") -> list[str]:
    """The ``psm_*`` segments of ``/dev/shm`` this process maps (names, sorted)."""
    try:
        with open(maps_path, encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    names = set()
    for line in lines:
        path = line.rsplit(" ", 1)[-1]
        folder, _, name = path.rpartition("/")
        if folder == SHM_DIR and _SEGMENT_RE.match(name):
            names.add(name)
    return sorted(names)


def record(folder: str) -> None:
    """Write the segments this process maps into ``folder``'s record (mode ``0600``)."""
    names = mapped_segments()[:_MAX_RECORDED]
    path = os.path.join(folder, RECORD_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write("".join(name + "\n" for name in names))
    except OSError as exc:  # the record only helps a later clean-up
        logger.debug("cannot record shared-memory segments in %s: %s", folder, exc)


def _recorded(folder: str) -> list[str]:
    try:
        with open(os.path.join(folder, RECORD_FILE), encoding="ascii", errors="replace") as fh:
            lines = fh.read(4096).splitlines()
    except OSError:
        return []
    return [name for name in lines[:_MAX_RECORDED] if _SEGMENT_RE.match(name)]


def _mapped_by_anyone(names: set[str]) -> set[str]:
    """Which of ``names`` a running process (that this user may inspect) maps."""
    found: set[str] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return set(names)  # cannot tell: treat every one as in use
    for pid in pids:
        found.update(n for n in mapped_segments(f"/proc/{pid}/maps") if n in names)
        if found == names:
            break
    return found


def remove_recorded(folder: str) -> list[str]:
    """Unlink the segments ``folder``'s record names that still exist, belong to this user and
    no running process maps; returns their names. The owner of ``folder`` must have ended."""
    names = set()
    for name in _recorded(folder):
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == os.geteuid():
                names.add(name)
    removed = []
    for name in sorted(names - _mapped_by_anyone(names)):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    if removed:
        logger.info(
            "removed %d shared-memory segments of an engine that no longer runs", len(removed)
        )
    return removed
