"""The shared secret: every Redis value written is sealed with an HMAC over its key and bytes, and
a value with a missing or wrong tag is never loaded (a real ``redis-server``, per test)."""

from __future__ import annotations

import os

import pytest
import torch
from segment_cases import FP, FP_HEX, LAYOUT, key_of, make_kv, same, warnings_with

from lmcache_backend.config import ConfigError, load_config
from lmcache_backend.storage import ExpectedLayout, MemoryTier, TieredStore, create_store, serde
from lmcache_backend.storage.remote.auth import MAGIC, AuthenticationError, EntryAuth
from lmcache_backend.storage.remote.tier import DEFAULT_PREFIX, RedisTier, redis_key
from lmcache_backend.storage.segments import SegmentKV
from lmcache_backend.storage.settings import store_settings

SECRET = b"0123456789abcdef-shared-secret"


def _tier(url: str, secret: bytes | None = SECRET) -> RedisTier:
    auth = EntryAuth(secret) if secret is not None else None
    return RedisTier(url, FP_HEX, ExpectedLayout.from_fingerprint(FP), auth=auth)


def _forged(key: str) -> bytes:
    """A well-formed, checksummed entry for ``key`` holding zeros: what a writer without the
    secret can store."""
    real = make_kv(key)
    zeros = SegmentKV(torch.zeros_like(real.keys), torch.zeros_like(real.values), 0)
    return serde.encode(key, zeros, FP_HEX, LAYOUT)


def test_sealed_values_round_trip_and_name_their_key(server) -> None:
    tier = _tier(server.url)
    key = key_of(1)
    assert tier.put(key, make_kv(key))
    raw = server.client().get(redis_key(DEFAULT_PREFIX, key))
    assert raw.startswith(MAGIC)
    entry = EntryAuth(SECRET).open(key, raw)
    assert same(serde.decode(entry, key, FP_HEX, LAYOUT), make_kv(key))
    with pytest.raises(AuthenticationError):  # the tag binds the key: no moving entries
        EntryAuth(SECRET).open(key_of(2), raw)
    assert same(tier.get(key), make_kv(key)) and tier.refused == 0
    tier.close()


@pytest.mark.parametrize("tag", ["none", "another secret", "moved from another key", "flipped"])
def test_planted_value_with_a_bad_tag_is_never_loaded(server, caplog, tag) -> None:
    tier = _tier(server.url)
    key, other = key_of(3), key_of(4)
    if tag == "none":
        planted = _forged(key)
    elif tag == "another secret":
        planted = EntryAuth(b"not-the-secret-0123456789").seal(key, _forged(key))
    elif tag == "moved from another key":  # a genuine value, stored under another key
        planted = EntryAuth(SECRET).seal(other, serde.encode(key, make_kv(key), FP_HEX, LAYOUT))
    else:  # the right secret's tag over other bytes: one bit of the entry changed after sealing
        sealed = bytearray(EntryAuth(SECRET).seal(key, _forged(key)))
        sealed[-1] ^= 1
        planted = bytes(sealed)
    client = server.client()
    client.set(redis_key(DEFAULT_PREFIX, key), planted)
    assert tier.contains(key)  # the scheduler's lookup may still claim it: advisory
    assert tier.get(key) is None
    assert tier.refused == 1
    assert warnings_with(caplog, "refusing segment")
    # deleted, so that a genuine computation can be stored (SET NX keeps the first value)
    assert client.get(redis_key(DEFAULT_PREFIX, key)) is None
    assert tier.put(key, make_kv(key)) and same(tier.get(key), make_kv(key))
    assert tier.replaced == 1
    tier.close()


def test_a_store_with_a_secret_counts_refusals_and_misses(server) -> None:
    cpu = MemoryTier("cpu", 1 << 20, name="cpu")
    store = TieredStore([cpu, _tier(server.url)])
    key = key_of(5)
    server.client().set(redis_key(DEFAULT_PREFIX, key), _forged(key))
    assert store.get(key) is None
    stats = store.stats()
    assert stats["refused"] == {"cpu": 0, "redis": 1} and stats["misses"] == 1
    assert not cpu.contains(key), "a refused value is not copied into a faster tier"
    store.close()


def test_without_a_secret_sealed_values_are_not_used_and_plain_ones_are(server, caplog) -> None:
    sealed, plain = _tier(server.url), _tier(server.url, secret=None)
    key, key2 = key_of(6), key_of(7)
    assert sealed.put(key, make_kv(key))
    assert plain.get(key) is None and warnings_with(caplog, "this engine has none")
    kept = server.client().get(redis_key(DEFAULT_PREFIX, key))
    assert kept is not None, "kept for engines with it"
    assert plain.put(key2, make_kv(key2)) and same(plain.get(key2), make_kv(key2))
    assert sealed.get(key2) is None and sealed.refused == 1
    sealed.close()
    plain.close()


def _config(server, tmp_path, **extra):
    return load_config(
        env={},
        remote_url=server.url,
        extra_config={"segment_index_dir": str(tmp_path / "index"), **extra},
    )


def test_create_store_reads_the_secret_file(server, tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")  # a trailing newline is not part of the secret
    os.chmod(path, 0o600)
    store = create_store(_config(server, tmp_path, shared_secret_file=str(path)), fingerprint=FP)
    key = key_of(8)
    assert store.put(key, make_kv(key))
    assert EntryAuth(SECRET).open(key, server.client().get(redis_key(DEFAULT_PREFIX, key)))
    store.close()


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"shared_secret": "short"}, r"extra_config.shared_secret .*<hidden, 5 bytes>.*at least"),
        ({"shared_secret_file": "/nonexistent/secret"}, r"shared_secret_file .*cannot open"),
        ({"shared_secret_file": "/"}, r"shared_secret_file .*"),
        ({"shared_secret_file": "/tmp/\ud800"}, r"shared_secret_file .*not a valid path"),
        (
            {"shared_secret": "x" * 20, "shared_secret_file": "/etc/hostname"},
            "not both",
        ),
        ({"shared_secret": 12345678901234567890}, r"shared_secret .*<hidden>"),
    ],
    ids=["short", "missing file", "a folder", "unencodable path", "both", "not a string"],
)
def test_bad_secret_settings_name_the_key_and_hide_the_value(server, tmp_path, extra, match):
    config = _config(server, tmp_path, **extra)
    with pytest.raises(ConfigError, match=match) as err:
        store_settings(config)
    if isinstance(extra.get("shared_secret"), str):
        assert extra["shared_secret"] not in str(err.value)
    if "shared_secret" in extra:
        assert str(extra["shared_secret"]) not in config.describe()
        assert "<hidden>" in config.describe()


def test_short_secret_file_and_readable_file_warn_or_fail(tmp_path, caplog) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"tooshort\n")
    config = load_config(env={}, extra_config={"shared_secret_file": str(path)})
    with pytest.raises(ConfigError, match="holds 8 bytes"):
        store_settings(config)
    path.write_bytes(SECRET)
    os.chmod(path, 0o644)
    assert store_settings(config).secret == SECRET
    assert warnings_with(caplog, "can be read by other users")
    assert warnings_with(caplog, "no effect without remote_url")
