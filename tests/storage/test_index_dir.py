"""The index folder is private (0700, markers 0600, no symlink, no other user's folder), owned by
the process that keeps it, and removed when that process ends: a normal exit, SIGTERM (with
the default handler, or one raising SystemExit as vLLM's processes do), a multiprocessing child's
exit, and, after SIGKILL, at the next start. Real processes throughout."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from lmcache_backend.storage import FileSegmentIndex, IndexDirError, create_store
from lmcache_backend.storage.lookup.index_dir import OWNER_FILE, base_dir, default_index_dir

KEY = "ab" * 32

# Keeps an index in argv[1] (default_location when argv[2] == "default"), says "ready", then
# waits; argv[3] == "systemexit": SIGTERM raises SystemExit, as in vLLM's engine and workers.
_KEEPER = """
import signal, sys, time
from lmcache_backend.storage import FileSegmentIndex
if len(sys.argv) > 3 and sys.argv[3] == "systemexit":
    def stop(signum, frame):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
index = FileSegmentIndex(sys.argv[1], default_location=sys.argv[2] == "default")
index.add("@KEY@")
print("ready", flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)
time.sleep(600)
""".replace("@KEY@", KEY)


def _keeper(folder, mode: str = "plain", how: str = "") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KEEPER, str(folder), mode, how],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def _gone(path, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_folder_and_markers_are_owner_only(tmp_path) -> None:
    index = FileSegmentIndex(tmp_path / "index")
    index.add(KEY)
    assert _mode(tmp_path / "index") == 0o700
    assert _mode(tmp_path / "index" / KEY) == 0o600
    owner = (tmp_path / "index" / OWNER_FILE).read_text().split()
    assert int(owner[0]) == os.getpid()
    assert index.keys() == [KEY]
    assert index.remove() and not (tmp_path / "index").exists()


def test_default_location_is_per_user_and_private() -> None:
    folder = default_index_dir(f"test-{os.getpid()}")
    assert os.path.basename(base_dir()) == f"lmcache_backend-{os.geteuid()}"
    index = FileSegmentIndex(folder, default_location=True)
    try:
        for path in (base_dir(), os.path.dirname(folder), folder):
            assert _mode(path) == 0o700, path
    finally:
        index.remove()
    assert not os.path.exists(folder)


def test_a_symlink_is_refused(tmp_path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "index").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(IndexDirError, match=r"segment_index_dir = .*index'.*symlink"):
        FileSegmentIndex(tmp_path / "index")
    assert os.listdir(tmp_path / "elsewhere") == []
    from lmcache_backend.config import ConfigError, load_config

    config = load_config(env={}, extra_config={"segment_index_dir": str(tmp_path / "index")})
    with pytest.raises(ConfigError, match="symlink"):  # the store fails to start, naming it
        create_store(config)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_another_users_folder_is_refused(tmp_path) -> None:
    folder = tmp_path / "index"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(IndexDirError, match="owned by uid 65534"):
        FileSegmentIndex(folder)
    assert not (folder / OWNER_FILE).exists()


def test_an_own_folder_with_wider_permissions_is_narrowed(tmp_path) -> None:
    folder = tmp_path / "index"
    folder.mkdir()
    folder.chmod(0o755)
    FileSegmentIndex(folder).remove()
    folder.mkdir()
    folder.chmod(0o777)
    FileSegmentIndex(folder)
    assert _mode(folder) == 0o700


def test_the_lookup_side_never_creates_the_folder(tmp_path) -> None:
    lookup = FileSegmentIndex(tmp_path / "index", create=False)
    assert lookup.contains_many([KEY]) == [False]
    assert not (tmp_path / "index").exists()


def test_removed_when_the_process_exits(tmp_path) -> None:
    proc = _keeper(tmp_path / "index", "exit")
    assert proc.wait(timeout=30) == 0
    assert _gone(tmp_path / "index")


@pytest.mark.parametrize("how", ["default handler", "systemexit"])
def test_removed_on_sigterm(tmp_path, how) -> None:
    proc = _keeper(tmp_path / "index", "plain", how)
    assert (tmp_path / "index" / KEY).exists()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    # the default handler still ends the process by the signal, as before
    assert code == (-signal.SIGTERM if how == "default handler" else 0)
    assert _gone(tmp_path / "index")


def _child(folder: str, ready) -> None:
    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)  # as vLLM's worker processes do
    FileSegmentIndex(folder).add(KEY)
    ready.set()
    time.sleep(600)


def test_removed_when_a_multiprocessing_child_is_terminated(tmp_path) -> None:
    """A forked multiprocessing child ends with os._exit, so atexit never runs there (a spawned
    one, as vLLM's workers here, exits normally: the exit test above); the folder goes all the
    same, by the finalizers multiprocessing runs before that."""
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_child, args=(str(tmp_path / "index"), ready))
    child.start()
    assert ready.wait(60)
    assert (tmp_path / "index" / KEY).exists()
    child.terminate()  # SIGTERM
    child.join(30)
    assert _gone(tmp_path / "index")


def test_next_start_removes_folders_of_processes_that_no_longer_run(tmp_path) -> None:
    parent = tmp_path / "base" / "index"
    running = _keeper(parent / "running", "default")
    killed = _keeper(parent / "killed", "default")
    killed.kill()  # SIGKILL: nothing runs, the folder stays behind
    killed.wait(timeout=30)
    reused = parent / "reused"  # a record naming a running pid with another start time
    reused.mkdir(mode=0o700)
    (reused / OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    (reused / KEY).touch()
    foreign = parent / "not-ours"  # no owner record: not an index folder of this package
    foreign.mkdir()
    try:
        assert (parent / "killed" / KEY).exists()
        FileSegmentIndex(parent / "new", default_location=True)
        assert not (parent / "killed").exists()
        assert not reused.exists()
        assert (parent / "running" / KEY).exists(), "a running engine's folder is kept"
        assert foreign.exists()
    finally:
        running.kill()
        running.wait(timeout=30)


def test_the_lookup_removes_the_folder_of_a_worker_killed_before_it(tmp_path) -> None:
    """vLLM SIGKILLs a worker that outlives its engine: the scheduler side (the engine process)
    removes the folder when it closes, once the owner is gone, and keeps it while it runs."""
    from lmcache_backend.storage import SegmentLookup

    folder = tmp_path / "index"
    worker = _keeper(folder)
    lookup = SegmentLookup(FileSegmentIndex(folder, create=False))
    lookup.close(wait_s=0.2)
    assert (folder / KEY).exists(), "the worker still runs: its folder stays"
    worker.kill()
    worker.wait(timeout=30)
    lookup.close(wait_s=2.0)
    assert not folder.exists()


# A worker as vLLM's: it maps a shared-memory segment (vLLM's message queues), then keeps an
# index in argv[1]'s default location; prints the segment's name and waits to be killed.
_ENGINE = """
import sys, time
from multiprocessing import shared_memory
from lmcache_backend.storage import FileSegmentIndex
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
segment.buf[:4] = b"used"
FileSegmentIndex(sys.argv[1], default_location=True).add("@KEY@")
print(segment.name, flush=True)
time.sleep(600)
""".replace("@KEY@", KEY)


def test_a_crash_loop_leaves_only_the_last_engines_folder_and_segments(tmp_path) -> None:
    """SIGKILL of the whole engine (its process group: the resource tracker that would unlink
    the segment dies with it), restarted five times: each start removes what the killed one
    left, its index folder and its shared-memory segments, and nothing that still runs."""
    parent = tmp_path / "base" / "index"
    left: list[tuple[str, str]] = []  # (index folder, segment) of each killed engine
    for i in range(5):
        folder = parent / f"vllm-{i}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _ENGINE, str(folder)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        segment = proc.stdout.readline().strip()
        assert segment.startswith("psm_") and os.path.exists(f"/dev/shm/{segment}")
        for old_folder, old_segment in left:
            assert not os.path.exists(old_folder), "the killed engine's folder"
            assert not os.path.exists(f"/dev/shm/{old_segment}"), "the killed engine's segment"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left.append((str(folder), segment))
        assert os.path.exists(f"/dev/shm/{segment}"), "nothing unlinks it at the kill"
    assert sorted(os.listdir(parent)) == ["vllm-4"], "only the last engine's, until a start"
    FileSegmentIndex(parent / "next", default_location=True)
    assert not os.path.exists(f"/dev/shm/{left[-1][1]}") and not os.path.exists(left[-1][0])


def test_a_segment_a_running_process_maps_is_kept(tmp_path) -> None:
    """A recorded segment that another running process still maps is not unlinked."""
    from multiprocessing import shared_memory

    from lmcache_backend.storage.lookup import shm_leftovers

    segment = shared_memory.SharedMemory(create=True, size=4096)
    try:
        folder = tmp_path / "dead"
        folder.mkdir()
        (folder / shm_leftovers.RECORD_FILE).write_text(segment.name + "\n")
        assert segment.name in shm_leftovers.mapped_segments()
        assert shm_leftovers.remove_recorded(str(folder)) == []
        assert os.path.exists(f"/dev/shm/{segment.name}")
    finally:
        segment.close()
        segment.unlink()


def test_a_half_removed_folder_is_finished(tmp_path) -> None:
    """A folder whose owner record an older cleanup removed, leaving the shared-memory record
    it did not know: removed by the next start; a folder with neither record is not ours."""
    from lmcache_backend.storage.lookup import shm_leftovers

    parent = tmp_path / "base" / "index"
    half = parent / "half"
    half.mkdir(parents=True, mode=0o700)
    (half / shm_leftovers.RECORD_FILE).write_text("")
    foreign = parent / "not-ours"
    foreign.mkdir()
    FileSegmentIndex(parent / "next", default_location=True)
    assert not half.exists() and foreign.exists()
