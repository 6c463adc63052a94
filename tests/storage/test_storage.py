"""Local storage tiers: codec integrity, memory/disk tiers, tiered store, index, concurrency."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from repo_paths import REPO_ROOT
from segment_cases import (
    FP,
    FP_HEX,
    LAYOUT,
    OTHER_FP,
    entry_bytes,
    key_of,
    make_kv,
    same,
    soak,
    warnings_with,
)

from lmcache_backend.config import load_config
from lmcache_backend.storage import (
    CorruptEntryError,
    DiskTier,
    ExpectedLayout,
    FileSegmentIndex,
    FingerprintMismatchError,
    MemoryTier,
    TieredStore,
    create_lookup,
    create_store,
    serde,
)
from lmcache_backend.storage.segments import SegmentKV

REPO = str(REPO_ROOT)


# -- codec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_codec_round_trip(dtype):
    key = key_of(1)
    kv = make_kv(key, n=5, dtype=dtype)
    layout = ExpectedLayout(2, 2, 8, dtype)
    out = serde.decode(serde.encode(key, kv, FP_HEX), key, FP_HEX, layout)
    assert same(out, kv)


def _flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0x55]) + data[pos + 1 :]


def test_codec_rejects_every_truncation_and_bit_flip():
    key = key_of(2)
    data = serde.encode(key, make_kv(key), FP_HEX)
    header_end = 8 + int.from_bytes(data[:8], "little")
    for cut in [0, 4, 8, header_end - 1, header_end, header_end + 1, len(data) - 1]:
        with pytest.raises(CorruptEntryError):
            serde.decode(data[:cut], key, FP_HEX, LAYOUT)
    with pytest.raises(CorruptEntryError, match="size"):
        serde.decode(data + b"\0", key, FP_HEX, LAYOUT)
    for pos in [header_end, (header_end + len(data)) // 2, len(data) - 1]:
        with pytest.raises(CorruptEntryError, match="checksum"):
            serde.decode(_flip(data, pos), key, FP_HEX, LAYOUT)
    with pytest.raises(CorruptEntryError):
        serde.decode(_flip(data, 2), key, FP_HEX, LAYOUT)  # header length byte


def test_codec_rejects_wrong_key_fingerprint_and_layout():
    key = key_of(3)
    data = serde.encode(key, make_kv(key), FP_HEX)
    with pytest.raises(CorruptEntryError, match="key"):
        serde.decode(data, key_of(4), FP_HEX, LAYOUT)
    with pytest.raises(FingerprintMismatchError):
        serde.decode(data, key, serde.fingerprint_hex(OTHER_FP), LAYOUT)
    with pytest.raises(CorruptEntryError, match="kv_heads"):
        serde.decode(data, key, FP_HEX, ExpectedLayout(2, 4, 8, torch.float32))
    with pytest.raises(CorruptEntryError, match="dtype"):
        serde.decode(data, key, FP_HEX, ExpectedLayout(2, 2, 8, torch.bfloat16))


def test_codec_rejects_header_that_disagrees_with_tensors():
    # A well-formed file whose metadata lies about the shape must not be used.
    key = key_of(5)
    kv = make_kv(key)
    data = bytearray(serde.encode(key, kv, FP_HEX))
    text = data.decode("latin-1")
    assert '"shape":"[2, 3, 2, 8]"' in text
    forged = text.replace('"shape":"[2, 3, 2, 8]"', '"shape":"[2, 3, 8, 2]"').encode("latin-1")
    with pytest.raises(CorruptEntryError, match="tensor"):
        serde.decode(forged, key, FP_HEX, None)


def _with_provenance(kv: SegmentKV, prior: bool) -> SegmentKV:
    layers, n = kv.keys.shape[:2]
    g = torch.Generator().manual_seed(n)
    return SegmentKV(
        kv.keys,
        kv.values,
        kv.start_position,
        context="ab" * 32,
        preceding=("0123456789abcdef", "fedcba9876543210"),
        staleness=torch.rand(layers, n, generator=g).half() if prior else None,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("prior", [False, True], ids=["provenance", "with prior"])
def test_codec_keeps_provenance_and_staleness_prior(dtype, prior):
    """A segment's provenance (the digest of what preceded it, the units before it) and its
    staleness prior survive the codec; only an entry with a prior is written as v2, its prior
    under the checksum like the K/V (safetensors lays fp16 out between fp16 keys and values)."""
    key = key_of(11)
    kv = _with_provenance(make_kv(key, n=5, dtype=dtype), prior)
    data = serde.encode(key, kv, FP_HEX)
    assert (serde.FORMAT_V2.encode() in data) == prior
    layout = ExpectedLayout(2, 2, 8, dtype)
    out = serde.decode(data, key, FP_HEX, layout)
    assert same(out, kv)
    assert out.context == kv.context and out.preceding == kv.preceding
    if prior:
        assert torch.equal(out.staleness, kv.staleness)
        header_end = 8 + int.from_bytes(data[:8], "little")
        header = json.loads(data[8:header_end])
        begin, end = header["staleness"]["data_offsets"]
        with pytest.raises(CorruptEntryError, match="checksum"):
            serde.decode(_flip(data, header_end + begin), key, FP_HEX, layout)
        for cut in (header_end + end - 1, len(data) - 1):
            with pytest.raises(CorruptEntryError):
                serde.decode(data[:cut], key, FP_HEX, layout)
    else:
        assert out.staleness is None
    with pytest.raises(ValueError, match="staleness"):
        SegmentKV(kv.keys, kv.values, 0, staleness=torch.zeros(2, 4))


def test_codec_reads_an_entry_written_before_provenance_as_unknown():
    """Entries stored by earlier releases (no provenance metadata) stay readable: their
    provenance is unknown (None), not empty."""
    key = key_of(7)
    data = (REPO_ROOT / "tests" / "fixtures" / "segment_entry_v1.safetensors").read_bytes()
    out = serde.decode(data, key, FP_HEX, LAYOUT)
    assert same(out, make_kv(key))
    assert out.context is None and out.preceding is None and out.staleness is None

    # and an entry without provenance is still written as then (the same header fields; their
    # order in the JSON is not fixed)
    def fields(entry: bytes) -> dict:
        header = json.loads(entry[8 : 8 + int.from_bytes(entry[:8], "little")])
        return {name: sorted(value) for name, value in header.items()}

    assert fields(serde.encode(key, make_kv(key), FP_HEX)) == fields(data)


# -- memory tier -----------------------------------------------------------------------------


def test_memory_tier_round_trip_owns_its_copies():
    tier = MemoryTier(torch.device("cpu"), 10 * entry_bytes(), name="device")
    key = key_of(10)
    kv = make_kv(key)
    original = make_kv(key)
    assert tier.put(key, kv)
    kv.keys.add_(1.0)  # the caller reuses its buffer: the cache must not change
    got = tier.get(key)
    assert same(got, original)
    got.keys.mul_(0.0)  # the caller re-rotates in place: the cache must not change
    assert same(tier.get(key), original)
    assert tier.contains(key) and not tier.contains(key_of(11))
    assert tier.nbytes == entry_bytes()


def test_memory_tier_evicts_least_recently_used():
    tier = MemoryTier("cpu", 3 * entry_bytes(), name="cpu")
    evicted = []
    tier.add_evict_listener(evicted.append)
    k = [key_of(20 + i) for i in range(5)]
    for key in k[:3]:
        assert tier.put(key, make_kv(key))
    assert tier.get(k[0]) is not None  # k0 becomes most recent; k1 is now the oldest
    tier.put(k[3], make_kv(k[3]))
    assert evicted == [k[1]]
    tier.put(k[4], make_kv(k[4]))
    assert evicted == [k[1], k[2]]
    assert tier.keys() == [k[0], k[3], k[4]]
    assert tier.nbytes == 3 * entry_bytes()


def test_memory_tier_first_writer_wins_and_oversize_is_skipped(caplog):
    tier = MemoryTier("cpu", 2 * entry_bytes(n=3), name="cpu")
    key = key_of(30)
    first = make_kv(key)
    assert tier.put(key, first)
    assert tier.put(key, make_kv(key_of(31)))  # same key, other content: kept as first
    assert same(tier.get(key), first)
    with caplog.at_level(logging.WARNING):
        assert not tier.put(key_of(32), make_kv(key_of(32), n=7))
    assert warnings_with(caplog, "exceeds its capacity")
    assert not tier.contains(key_of(32))


# -- disk tier -------------------------------------------------------------------------------


def _disk(tmp_path, capacity_entries: int = 10, fp: str | None = FP_HEX) -> DiskTier:
    size = len(serde.encode(key_of(0), make_kv(key_of(0)), FP_HEX))
    return DiskTier(tmp_path / "disk", capacity_entries * size, fp, LAYOUT)


def test_disk_tier_round_trip_and_persistence(tmp_path):
    tier = _disk(tmp_path)
    keys = [key_of(40 + i) for i in range(3)]
    for key in keys:
        assert tier.put(key, make_kv(key))
    files = sorted(os.listdir(tmp_path / "disk"))
    assert files == sorted(k + ".safetensors" for k in keys)  # no temporary files left
    for key in keys:
        assert same(tier.get(key), make_kv(key))
    reopened = _disk(tmp_path)  # a restarted engine finds the files
    assert len(reopened) == 3 and reopened.nbytes == tier.nbytes
    assert same(reopened.get(keys[1]), make_kv(keys[1]))
    assert reopened.get(key_of(49)) is None


def test_disk_tier_evicts_by_access_time_also_after_restart(tmp_path):
    tier = _disk(tmp_path, capacity_entries=3)
    k = [key_of(50 + i) for i in range(5)]
    for i, key in enumerate(k[:3]):
        tier.put(key, make_kv(key))
        os.utime(tier._path(key), (1000.0 + i, 1000.0 + i))  # distinct, ordered mtimes
    assert tier.get(k[0]) is not None  # refreshes k0's mtime: k1 is the oldest
    tier.put(k[3], make_kv(k[3]))
    assert not os.path.exists(tier._path(k[1]))
    assert tier.keys() == [k[2], k[0], k[3]]
    reopened = _disk(tmp_path, capacity_entries=3)  # the order is rebuilt from mtimes
    assert reopened.keys()[0] == k[2]
    reopened.put(k[4], make_kv(k[4]))
    assert not os.path.exists(reopened._path(k[2]))
    assert sorted(reopened.keys()) == sorted([k[0], k[3], k[4]])


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _flip_data_byte(path):
    with open(path, "r+b") as fh:
        fh.seek(-5, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))


def _garble_header(path):
    with open(path, "r+b") as fh:
        fh.seek(12)
        fh.write(b"#####")


def _empty(path):
    open(path, "wb").close()


@pytest.mark.parametrize("damage", [_truncate, _flip_data_byte, _garble_header, _empty])
def test_disk_tier_drops_corrupted_file(tmp_path, caplog, damage):
    tier = _disk(tmp_path)
    key = key_of(60)
    tier.put(key, make_kv(key))
    damage(tier._path(key))
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert tier.get(key) is None
    assert len(warnings_with(caplog, "refusing segment file")) == 1
    assert not os.path.exists(tier._path(key))
    assert not tier.contains(key) and tier.nbytes == 0
    assert tier.put(key, make_kv(key))  # a fresh copy can be stored again
    assert same(tier.get(key), make_kv(key))


def test_disk_tier_refuses_another_fingerprints_file_under_its_key(tmp_path, caplog):
    """Keys are digests of the fingerprint: under this model's key another model's entry is a
    misplaced file; it is refused and deleted so this model's own can be stored."""
    key = key_of(61)
    writer = _disk(tmp_path, fp=serde.fingerprint_hex(OTHER_FP))
    writer.put(key, make_kv(key))
    reader = _disk(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert reader.get(key) is None
    assert warnings_with(caplog, "fingerprint")
    assert not os.path.exists(reader._path(key))
    assert reader.put(key, make_kv(key)) and same(reader.get(key), make_kv(key))
    assert (reader.refused, reader.replaced) == (1, 1)


def test_disk_tier_full_disk_evicts_and_retries_once(tmp_path, caplog, monkeypatch):
    tier = _disk(tmp_path)
    old = [key_of(70 + i) for i in range(3)]
    for key in old:
        tier.put(key, make_kv(key))
    real_write = tier._write_file
    calls = []

    def full_once(key, data):
        calls.append(key)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(key, data)

    monkeypatch.setattr(tier, "_write_file", full_once)
    new = key_of(79)
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert tier.put(new, make_kv(new))
    assert calls == [new, new]
    assert warnings_with(caplog, "disk full")
    assert not os.path.exists(tier._path(old[0]))  # the oldest entry made room
    assert same(tier.get(new), make_kv(new))


def test_disk_tier_full_disk_twice_skips_without_raising(tmp_path, caplog, monkeypatch):
    tier = _disk(tmp_path)
    tier.put(key_of(80), make_kv(key_of(80)))

    def always_full(key, data):
        # behave like a real write that fails midway: leave a temporary file, then fail
        tmp = os.path.join(tier.folder, f".tmp-{key}-x")
        with open(tmp, "wb") as fh:
            fh.write(data[:10])
        os.unlink(tmp)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier, "_write_file", always_full)
    new = key_of(81)
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert tier.put(new, make_kv(new)) is False
    assert warnings_with(caplog, "not stored")
    assert tier.get(new) is None and not tier.contains(new)
    assert os.listdir(tier.folder) == []  # evicted while retrying, nothing half-written


def test_disk_tier_write_failure_leaves_no_temp_file(tmp_path, monkeypatch):
    tier = _disk(tmp_path)

    def fail_replace(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", fail_replace)
    assert tier.put(key_of(82), make_kv(key_of(82))) is False
    assert os.listdir(tier.folder) == []


def test_disk_tier_rejects_unsafe_keys(tmp_path):
    tier = _disk(tmp_path)
    with pytest.raises(ValueError):
        tier.get("../../etc/passwd")


# -- tiered store ----------------------------------------------------------------------------


def _tiered(tmp_path, device_entries=2, cpu_entries=4, disk_entries=10, index=True):
    tiers = [
        MemoryTier(torch.device("cpu"), device_entries * entry_bytes(), name="device"),
        MemoryTier("cpu", cpu_entries * entry_bytes(), name="cpu"),
        _disk(tmp_path, disk_entries),
    ]
    idx = FileSegmentIndex(tmp_path / "index") if index else None
    return TieredStore(tiers, idx), tiers


def test_tiered_store_writes_through_and_promotes_on_hit(tmp_path):
    store, (dev, cpu, disk) = _tiered(tmp_path)
    k = [key_of(100 + i) for i in range(6)]
    for key in k:
        assert store.put(key, make_kv(key))
    assert dev.keys() == k[4:] and cpu.keys() == k[2:] and len(disk) == 6
    # k0 lives only on disk now; a hit copies it into both memory tiers
    assert same(store.get(k[0]), make_kv(k[0]))
    assert dev.contains(k[0]) and cpu.contains(k[0])
    assert store.stats()["hits"] == {"device": 0, "cpu": 0, "disk": 1}
    assert same(store.get(k[0]), make_kv(k[0]))
    assert store.stats()["hits"]["device"] == 1
    assert store.get(key_of(199)) is None and store.stats()["misses"] == 1
    assert store.lookup([k[0], k[1], key_of(199)]) == [True, True, False]


def test_tiered_store_counts_stores_and_evictions_per_tier(tmp_path):
    store, (dev, cpu, disk) = _tiered(tmp_path)
    k = [key_of(120 + i) for i in range(6)]
    for key in k:
        store.put(key, make_kv(key))
    size = make_kv(k[0]).nbytes
    stats = store.stats()
    assert stats["stored"] == {"device": 6, "cpu": 6, "disk": 6}
    assert stats["stored_bytes"] == {"device": 6 * size, "cpu": 6 * size, "disk": 6 * size}
    # the device tier holds 2 entries, the CPU tier 4, the disk all 6
    assert stats["evicted"] == {"device": 4, "cpu": 2, "disk": 0}
    assert stats["bytes"]["device"] == 2 * size
    store.get(k[0])  # a disk hit, copied into both memory tiers: each evicts one more
    stats = store.stats()
    assert stats["stored"] == {"device": 7, "cpu": 7, "disk": 6}
    assert stats["evicted"] == {"device": 5, "cpu": 3, "disk": 0}


def test_tiered_store_index_follows_evictions(tmp_path):
    # memory tiers only: when the CPU tier evicts, nothing else holds the segment
    store, (dev, cpu, _) = _tiered(tmp_path)
    store = TieredStore([dev, cpu], FileSegmentIndex(tmp_path / "index2"))
    k = [key_of(110 + i) for i in range(6)]
    for key in k:
        store.put(key, make_kv(key))
    assert store.index.contains_many(k) == [False, False, True, True, True, True]
    store.clear()
    assert store.index.contains_many(k) == [False] * 6


def test_tiered_store_index_keeps_disk_entries_and_restarts_from_disk(tmp_path):
    store, _ = _tiered(tmp_path)
    k = [key_of(120 + i) for i in range(6)]
    for key in k:
        store.put(key, make_kv(key))
    assert store.index.contains_many(k) == [True] * 6  # on disk even when out of memory
    stale = key_of(129)
    store.index.add(stale)  # a marker left by a crashed engine
    restarted, _ = _tiered(tmp_path)
    assert restarted.index.contains_many(k + [stale]) == [True] * 6 + [False]


def test_create_store_builds_configured_tiers(tmp_path):
    config = load_config(
        env={},
        max_local_cpu_size=0.001,
        local_disk=f"file://{tmp_path}/d",
        max_local_disk_size=0.002,
        extra_config={"segment_index_dir": str(tmp_path / "i")},
    )
    store = create_store(config, device="cpu", fingerprint=FP)
    assert [t.name for t in store.tiers] == ["cpu", "disk"]  # no device tier for the CPU
    assert store.tiers[0].max_bytes == int(0.001 * 1024**3)
    assert store.tiers[1].folder == f"{tmp_path}/d" and store.tiers[1].fingerprint == FP_HEX
    key = key_of(130)
    store.put(key, make_kv(key))
    assert create_lookup(config).contains_many([key, key_of(131)]) == [True, False]
    only_cpu = create_store(
        load_config(env={}, local_disk=str(tmp_path)), index_dir=str(tmp_path / "i2")
    )
    assert [t.name for t in only_cpu.tiers] == ["cpu"]  # disk size 0: disk tier off
    assert not store.tiers[0].pin_memory


def test_cpu_tier_is_page_locked_for_a_cuda_model(tmp_path):
    """For a model on a CUDA device the CPU tier keeps its entries page-locked, so the blend's
    per-layer copies to the GPU can run asynchronously (nothing is allocated here)."""
    config = load_config(env={}, extra_config={"segment_index_dir": str(tmp_path / "i")})
    store = create_store(config, device=torch.device("cuda", 0), fingerprint=FP)
    assert [t.name for t in store.tiers] == ["cpu"] and store.tiers[0].pin_memory


def test_disk_tier_refuses_segment_of_another_layout(tmp_path, caplog):
    disk = _disk(tmp_path)
    key = key_of(140)
    wrong = SegmentKV(torch.zeros(3, 2, 2, 8), torch.zeros(3, 2, 2, 8), 0)  # 3 layers, not 2
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.storage"):
        assert disk.put(key, wrong) is False
    assert warnings_with(caplog, "layers is 3")
    assert not disk.contains(key) and os.listdir(disk.folder) == []


# -- cross-process index ---------------------------------------------------------------------

_SCHEDULER = r"""
import json, sys
from lmcache_backend.config import load_config
from lmcache_backend.storage import create_lookup
lookup = create_lookup(load_config(env={}), index_dir=sys.argv[1])
for line in sys.stdin:
    print(json.dumps(lookup.contains_many(json.loads(line))), flush=True)
"""


def test_index_is_visible_from_another_process(tmp_path):
    index_dir = str(tmp_path / "index")
    store = TieredStore(
        [MemoryTier("cpu", 2 * entry_bytes(), name="cpu")], FileSegmentIndex(index_dir)
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCHEDULER, index_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:

        def ask(keys):
            proc.stdin.write(json.dumps(keys) + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        k = [key_of(150 + i) for i in range(3)]
        assert ask(k) == [False, False, False]
        store.put(k[0], make_kv(k[0]))
        store.put(k[1], make_kv(k[1]))
        assert ask(k) == [True, True, False]
        store.put(k[2], make_kv(k[2]))  # evicts k0 from the only tier
        assert ask(k) == [False, True, True]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert proc.returncode == 0


# -- concurrency -----------------------------------------------------------------------------


def test_concurrent_soak_local_tiers(tmp_path):
    big = entry_bytes(n=6)
    tiers = [
        MemoryTier(torch.device("cpu"), 3 * big, name="device"),
        MemoryTier("cpu", 6 * big, name="cpu"),
        DiskTier(tmp_path / "disk", 12 * 3000, FP_HEX, LAYOUT),
    ]
    store = TieredStore(tiers, FileSegmentIndex(tmp_path / "index"))
    hits, puts, bad = soak([store], seconds=2.0)
    assert bad == 0
    assert hits > 100 and puts > 100
    assert all(t.nbytes <= t.max_bytes for t in tiers)
    assert [n for n in os.listdir(tmp_path / "disk") if n.startswith(".tmp")] == []
