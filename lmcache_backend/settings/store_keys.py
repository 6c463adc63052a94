"""The segment store's keys, under the engine key ``extra_config`` (LMCache's free-form mapping;
its other keys are left to LMCache). :func:`lmcache_backend.storage.settings.store_settings`
reads them into :class:`~lmcache_backend.storage.settings.StoreSettings`."""

from __future__ import annotations

from lmcache_backend.settings import parsers as p
from lmcache_backend.settings.setting import Scope, Setting

EVICTION_POLICIES = ("lru", "s3fifo")
ADMISSION_POLICIES = ("always", "second_sight")
#: the shortest shared secret, in bytes
MIN_SECRET_BYTES = 16


def _store(name: str, parse: p.Parser, default, description: str, **more) -> Setting:
    return Setting(name, Scope.STORE, parse, default, description, **more)


def _seconds(minimum: float = 0.0, above: bool = True) -> p.Parser:
    return p.number(minimum, above_minimum=above, unit="(s)")


def _key_prefix() -> p.Parser:
    """Non-empty text without braces: a brace would make the prefix a Redis Cluster hash tag,
    and every key ends with its segment's own tag ``{<key>}``."""
    inner = p.text(allow_empty=False)

    def convert(value) -> str:
        text = inner(value)
        if "{" in text or "}" in text:
            raise ValueError("must not hold { or }: keys end with the segment's hash tag {<key>}")
        return text

    return p.Parser(convert, "non-empty text without { or }", annotation="str")


STORE_KEYS: tuple[Setting, ...] = (
    # vLLM's KV cache needs the accelerator's memory: off unless asked for
    _store(
        "max_local_device_size",
        p.number(minimum=0.0, unit="(GB)"),
        0.0,
        "accelerator-memory tier capacity, GB; 0 turns it off",
    ),
    _store(
        "cache_policy",
        p.choice(*EVICTION_POLICIES),
        "s3fifo",
        "which entries the memory tiers evict first",
        details="`s3fifo` or `lru` (least recently used; case-insensitive, so LMCache's `LRU` "
        "works)",
    ),
    _store(
        "cache_admission",
        p.choice(*ADMISSION_POLICIES),
        "second_sight",
        "which new segments a full memory tier stores",
        details="`second_sight` (those it was offered before) or `always`",
    ),
    # the blender only reads its hits: the vLLM worker and the HF engine set false
    _store(
        "copy_on_get",
        p.boolean(),
        True,
        "memory tiers return copies, so callers may change results in place",
        details="`false` saves a copy per hit when every caller treats results as read-only, "
        "as the blender does",
        default_doc="`true` (`false` in the vLLM worker and the HF engine)",
    ),
    _store("segment_index", p.boolean(), True, "keep the cross-process index (marker files)"),
    _store(
        "segment_index_dir",
        p.optional(p.text(allow_empty=False)),
        None,
        "folder of the index; private to its user",
        details="under the temporary directory when `/dev/shm` is missing ([index]"
        "(docs/storage.md#cross-process-index-scheduler--worker))",
        default_doc="`/dev/shm/lmcache_backend-<uid>/index/<instance_id>`",
    ),
    _store(
        "remote_key_prefix",
        p.optional(_key_prefix()),
        None,
        "namespace of the keys in Redis",
        details="no braces: each key ends with its segment's Redis Cluster hash tag",
        default_doc="`lmcache_backend:segment:`",
    ),
    _store(
        "remote_cluster",
        p.optional(p.boolean(), "true or false, or null"),
        None,
        "`remote_url` is a Redis Cluster (`true`) or one server (`false`)",
        details="unset, the URL and the server say (a `redis+cluster://` "
        "scheme, several nodes, `?cluster=true`, or a node that reports `cluster_enabled`) "
        "([shared tier](docs/storage.md#the-shared-tier-one-server-a-cluster-or-sentinel))",
        default_doc="unset: detected",
    ),
    _store(
        "remote_sentinel_master",
        p.optional(p.text(allow_empty=False)),
        None,
        "the Sentinel master's name, for a `redis-sentinel://` URL without a `/<name>` path",
        default_doc="`$REDIS_SERVICE_NAME`, else `redismaster` (LMCache's)",
    ),
    _store(
        "remote_timeout",
        _seconds(),
        1.0,
        "socket timeout of one Redis command, s (must fit the largest value on your network)",
    ),
    _store("remote_connect_timeout", _seconds(), 0.25, "socket timeout of opening a connection, s"),
    _store(
        "remote_ttl",
        p.optional(_seconds(above=False)),
        None,
        "expiry of Redis entries, s; null (or 0): until the server evicts them",
    ),
    _store("remote_retry_base_delay", _seconds(), 0.5, "s before the first reconnection attempt"),
    _store("remote_retry_max_delay", _seconds(), 30.0, "cap of the doubling reconnection delay, s"),
    _store(
        "shared_secret_file",
        p.optional(p.text(allow_empty=False)),
        None,
        f"a file holding the secret (at least {MIN_SECRET_BYTES} bytes) that authenticates "
        "every Redis entry",
        details="surrounding whitespace ignored; warned about when other users can read it. "
        "Preferred: it stays out of process lists and vLLM's logged config ([security.md]"
        "(docs/security.md#the-shared-tier-a-secret-or-trust-everyone-who-can-write-to-redis))",
        group="secret",
    ),
    _store(
        "shared_secret",
        p.optional(p.text(allow_empty=False)),
        None,
        f"the secret itself (at least {MIN_SECRET_BYTES} bytes), instead of a file",
        details="never printed (`describe()`, errors: `<hidden>`)",
        group="secret",
        secret=True,
    ),
)
