"""The index folder's life: private to its user, owned by one process, removed when it ends.

The cross-process index (:mod:`lmcache_backend.storage.lookup.index`) names each marker file after a
segment key, so whoever can list the folder learns which segments an engine holds (and, for a
guessed document, whether it was sent). The folder is therefore:

* **private**: created with mode ``0700`` (markers ``0600``) under a per-user base
  (``/dev/shm/lmcache_backend-<uid>``, also ``0700``); a folder that already exists as a symlink,
  or that another user owns, is refused (:class:`IndexDirError`); one of ours with wider
  permissions (left by an older release) is narrowed to ``0700``;
* **owned**: the process that keeps the markers (the worker's store) writes its pid and start
  time into ``.lmcache_backend_owner``;
* **removed** when that process ends: on a normal exit (``atexit``), when a multiprocessing child
  (vLLM's worker processes) exits (its finalizers run even though ``atexit`` does not), on
  SIGTERM when nothing else handles it, and otherwise (SIGKILL, a crash) at the next start, which
  removes the sibling folders whose owner no longer runs, with the shared-memory segments the
  owner recorded (:mod:`lmcache_backend.storage.lookup.shm_leftovers`): a crash loop leaves at most
  the last engine's folder and segments behind.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import os
import re
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path

from lmcache_backend.config import ConfigError
from lmcache_backend.storage.lookup import shm_leftovers

logger = logging.getLogger(__name__)

OWNER_FILE = ".lmcache_backend_owner"
#: marker names (segment keys), the only other files an index folder holds
_MARKER_RE = re.compile(r"^[0-9a-f]{16,128}$")

# reentrant: the SIGTERM handler runs on the main thread, which may hold it at that moment
_lock = threading.RLock()
#: folders this process owns and removes when it ends
_owned: set[str] = set()
#: folders another process owns, removed when this one ends if that one is gone (the scheduler
#: watches its workers' folders: vLLM may SIGKILL a worker at shutdown)
_watched: set[str] = set()
#: the process that installed the exit hooks (a forked child installs its own)
_hooks_pid = 0


class IndexDirError(ConfigError):
    """The index folder cannot be used safely (a symlink, another user's, not a folder)."""


def base_dir() -> str:
    """``/dev/shm/lmcache_backend-<uid>`` (memory-backed), else the same under the temporary
    directory: one base per user, so no user creates folders inside another's."""
    shm = "/dev/shm"
    root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(root, f"lmcache_backend-{os.geteuid()}")


def default_index_dir(instance_id: str = "default") -> str:
    """``<base_dir()>/index/<instance_id>``. Scheduler and worker of one engine must use the
    same ``instance_id``; engines on one machine must use different ones."""
    if not re.match(r"^[A-Za-z0-9_.-]+$", instance_id) or instance_id in (".", ".."):
        raise ValueError(f"instance_id must be a plain name, got {instance_id!r}")
    return os.path.join(base_dir(), "index", instance_id)


def _refuse(key: str, folder: str, why: str) -> IndexDirError:
    return IndexDirError(f"{key} = {folder!r}: {why}; remove it or choose another folder")


def ensure_private_dir(folder: str, key: str = "segment_index_dir") -> None:
    """Create ``folder`` with mode ``0700`` or check the existing one.

    Raises:
        IndexDirError: ``folder`` is a symlink, not a folder, or owned by another user
            (the message names ``key`` and the folder).
    """
    try:
        os.mkdir(folder, 0o700)
        return
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(os.path.dirname(folder) or ".", exist_ok=True)
        try:
            os.mkdir(folder, 0o700)
            return
        except FileExistsError:
            pass
    # opened without following a symlink: the checks apply to the folder itself
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(folder):
            raise _refuse(key, folder, "it is a symlink") from None
        raise _refuse(key, folder, f"it is not a usable folder ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _refuse(key, folder, f"it is owned by uid {st.st_uid}, not by this user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            logger.info("%s %s: permissions narrowed to 0700", key, folder)
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def prepare(folder: str, default: bool) -> None:
    """Make ``folder`` a private index folder owned by this process.

    ``default``: ``folder`` is :func:`default_index_dir`'s; its base and ``index`` parent are
    made private too, and folders of engines that no longer run are removed from that parent.
    """
    folder = os.path.abspath(folder)
    if default:
        parent = os.path.dirname(folder)
        ensure_private_dir(os.path.dirname(parent))
        ensure_private_dir(parent)
        remove_stale(parent, keep=folder)
    ensure_private_dir(folder)
    _claim(folder)


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks (``/proc/<pid>/stat``), ``""`` where unknown:
    with the pid it names one process, even after the pid is reused."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # the command name (field 2) may hold spaces and parentheses: count from the last ")"
    fields = text[text.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else ""


def _owner_alive(record: str) -> bool:
    try:
        pid_text, _, start = record.strip().partition(" ")
        pid = int(pid_text)
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    if _process_state(pid) == "Z":  # killed, not yet reaped: it runs no more
        return False
    return not start or _process_start(pid) in ("", start)


def _process_state(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rfind(")") + 2 :].split(" ", 1)[0]


def _me() -> str:
    pid = os.getpid()
    return f"{pid} {_process_start(pid)}".strip()


def _read_owner(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, OWNER_FILE), encoding="ascii", errors="replace") as fh:
            return fh.read(200)
    except OSError:
        return None


def _claim(folder: str) -> None:
    previous = _read_owner(folder)
    me = _me()
    if previous and previous.strip() != me and _owner_alive(previous):
        logger.warning(
            "segment index %s was kept by the running process %s: two engines with one "
            "instance_id (or segment_index_dir)? This process takes it over",
            folder,
            previous.split()[0],
        )
    path = os.path.join(folder, OWNER_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(me + "\n")
    shm_leftovers.record(folder)
    with _lock:
        _owned.add(folder)
    _install_exit_hooks()


def remove(folder: str, force: bool = False) -> bool:
    """Delete ``folder``'s markers, owner record and the folder itself, if this process owns
    it (``force``: whoever does). Files that are not ours are left, and so is the folder then.
    Returns whether the folder is gone."""
    folder = os.path.abspath(folder)
    with _lock:
        _owned.discard(folder)
    if not force:
        owner = _read_owner(folder)
        if owner is None or owner.strip() != _me():
            return False
    try:
        names = os.listdir(folder)
    except OSError:
        return not os.path.lexists(folder)
    for name in names:
        if _MARKER_RE.match(name) or name in (OWNER_FILE, shm_leftovers.RECORD_FILE):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
    try:
        os.rmdir(folder)
    except OSError:
        return False
    return True


def remove_stale(parent: str, keep: str | None = None) -> list[str]:
    """Remove the index folders in ``parent`` whose owning process no longer runs (left by a
    SIGKILL or a crash); returns them. Only this user's folders with an owner record (or, half
    removed, the shared-memory record written after it) are touched."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        path = os.path.abspath(entry.path)
        if path == keep or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
        except OSError:
            continue
        owner = _read_owner(path)
        if owner is None:
            # half removed: a cleanup that did not know the shared-memory record (an older
            # release) deleted the owner record and left the folder; claimed folders always
            # have both, the owner written first
            if not os.path.exists(os.path.join(path, shm_leftovers.RECORD_FILE)):
                continue
        elif _owner_alive(owner):
            continue
        shm_leftovers.remove_recorded(path)
        if remove(path, force=True):
            removed.append(path)
    if removed:
        logger.info("removed %d index folders of engines that no longer run", len(removed))
    return removed


def remove_if_orphaned(folder: str, wait_s: float = 0.0) -> bool:
    """Remove ``folder`` once the process that owns it no longer runs, waiting up to ``wait_s``
    for it to end; returns whether the folder is gone. A folder whose owner still runs is kept.
    """
    folder = os.path.abspath(folder)
    deadline = time.monotonic() + wait_s
    while True:
        owner = _read_owner(folder)
        if owner is None:
            return not os.path.lexists(folder)
        if not _owner_alive(owner):
            shm_leftovers.remove_recorded(folder)
            return remove(folder, force=True)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def watch(folder: str) -> None:
    """Remove ``folder`` when this process ends, if its owner has ended by then (waiting a
    little for it): for the process that started the owner and outlives it."""
    with _lock:
        _watched.add(os.path.abspath(folder))
    _install_exit_hooks()


def remove_orphans_of_default_dir(wait_s: float = 5.0) -> list[str]:
    """Remove the folders under the default ``index/`` parent whose owner has ended, waiting up
    to ``wait_s`` for owners that are still running: what a server process runs once its engine
    stopped (vLLM SIGKILLs a worker that outlives the engine, and the engine may go the same
    way, so neither can remove the folder itself)."""
    parent = os.path.join(base_dir(), "index")
    deadline = time.monotonic() + wait_s
    removed = remove_stale(parent)
    while time.monotonic() < deadline:
        try:
            if not any(os.scandir(parent)):
                break
        except OSError:
            break
        time.sleep(0.1)
        removed += remove_stale(parent)
    return removed


def _remove_owned() -> None:
    with _lock:
        folders, watched = list(_owned), list(_watched)
        _watched.clear()
    for folder in folders:
        remove(folder)
    for folder in watched:
        remove_if_orphaned(folder, wait_s=2.0)


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM in a process that did not handle it: clean up, then die of it as before."""
    _remove_owned()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_exit_hooks() -> None:
    global _hooks_pid
    with _lock:
        if _hooks_pid == os.getpid():
            return
        _hooks_pid = os.getpid()
    atexit.register(_remove_owned)
    # a multiprocessing child ends with os._exit (no atexit) after running these finalizers
    multiprocessing.util.Finalize(None, _remove_owned, exitpriority=100)
    # SIGTERM kills a process whose handler is the default without running either; a process
    # that handles it (vLLM's engine and worker processes raise SystemExit) is left alone
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)
