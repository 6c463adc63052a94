"""Build the tiered store (worker side) and the segment lookup (scheduler side) from config.

LMCache keys used: ``local_cpu``, ``max_local_cpu_size`` (GB), ``local_disk`` (folder, optionally
``file://``-prefixed), ``max_local_disk_size`` (GB), ``remote_url`` (one Redis server, a Redis
Cluster or Sentinel: :mod:`lmcache_backend.storage.remote.url`). Settings without an LMCache name
are read from ``extra_config`` (see :data:`~lmcache_backend.storage.settings.EXTRA_DEFAULTS`),
checked by :func:`~lmcache_backend.storage.settings.store_settings`.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from lmcache_backend.config import BlendConfig
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage.disk import DiskTier
from lmcache_backend.storage.lookup.index import FileSegmentIndex, SegmentIndex, SegmentLookup
from lmcache_backend.storage.lookup.index_dir import default_index_dir
from lmcache_backend.storage.memory import MemoryTier
from lmcache_backend.storage.remote.auth import EntryAuth
from lmcache_backend.storage.serde import ExpectedLayout, fingerprint_hex
from lmcache_backend.storage.settings import (
    EXTRA_DEFAULTS,  # noqa: F401 - its old home
    StoreSettings,
    store_settings,
)
from lmcache_backend.storage.tier import Tier
from lmcache_backend.storage.tiered import TieredStore

logger = logging.getLogger(__name__)

GB = 1024**3


def disk_folder(config: BlendConfig) -> str | None:
    """The disk tier's folder (``local_disk`` without ``file://``), or None."""
    folder = config.local_disk
    if not folder:
        return None
    return folder[len("file://") :] if folder.startswith("file://") else folder


def _index(
    settings: StoreSettings, instance_id: str, index_dir: str | None, create: bool
) -> SegmentIndex | None:
    """The index: created and owned by the worker's store (``create``), read by the lookup."""
    if not settings.segment_index:
        return None
    folder = index_dir or settings.segment_index_dir
    if folder:
        return FileSegmentIndex(folder, create=create)
    return FileSegmentIndex(default_index_dir(instance_id), create=create, default_location=True)


def _remote(
    settings: StoreSettings,
    fingerprint: str | None,
    layout: ExpectedLayout | None,
    shard: str = "",
) -> Tier | None:
    if settings.remote is None:
        return None
    from lmcache_backend.storage.remote.tier import DEFAULT_PREFIX, RedisTier

    return RedisTier(
        settings.remote,
        fingerprint=fingerprint,
        layout=layout,
        prefix=(settings.remote_key_prefix or DEFAULT_PREFIX) + (f"{shard}:" if shard else ""),
        timeout=settings.remote_timeout,
        connect_timeout=settings.remote_connect_timeout,
        ttl=settings.remote_ttl or None,
        retry_base_delay=settings.remote_retry_base_delay,
        retry_max_delay=settings.remote_retry_max_delay,
        auth=EntryAuth(settings.secret) if settings.secret is not None else None,
    )


def create_store(
    config: BlendConfig,
    device: torch.device | str | None = None,
    *,
    fingerprint: ModelFingerprint | None = None,
    num_kv_heads: int | None = None,
    shard: str = "",
    instance_id: str = "default",
    index_dir: str | None = None,
) -> TieredStore:
    """The worker's segment store: device, CPU, disk and Redis tiers as configured.

    Args:
        config: the configuration.
        device: the accelerator; a device tier is added when it is not the CPU and
            ``extra_config["max_local_device_size"]`` > 0.
        fingerprint: the model's fingerprint, written into and required of every stored entry,
            and the source of the expected layout ``[L, n, Hkv, D]`` and dtype checked on load.
        num_kv_heads: KV heads this process holds when it is a tensor-parallel shard.
        shard: names that shard (e.g. ``"tp1of4"``; ``""`` without tensor parallelism). Ranks
            compute different K/V under the same segment key, so the shard namespaces the disk
            folder (``<local_disk>/<shard>``) and the Redis keys, and is part of the fingerprint
            check.
        instance_id: names the default index folder; the scheduler's :func:`create_lookup`
            must use the same id.
        index_dir: index folder, overriding ``extra_config["segment_index_dir"]``.

    Raises:
        ConfigError: an ``extra_config`` setting is invalid, or the index folder cannot be
            used safely (:class:`~lmcache_backend.storage.lookup.index_dir.IndexDirError`).
    """
    settings = store_settings(config)
    if shard and not re.match(r"^[A-Za-z0-9_.-]+$", shard):
        raise ValueError(f"shard must be a plain name, got {shard!r}")
    fp = fingerprint_hex(fingerprint, shard) if fingerprint is not None else None
    layout = (
        ExpectedLayout.from_fingerprint(fingerprint, num_kv_heads)
        if fingerprint is not None
        else None
    )
    copy_on_get = settings.copy_on_get
    policies = {"eviction": settings.cache_policy, "admission": settings.cache_admission}
    tiers: list[Tier] = []
    device_gb = settings.max_local_device_size
    if device is not None and torch.device(device).type != "cpu" and device_gb > 0:
        tiers.append(MemoryTier(device, int(device_gb * GB), "device", copy_on_get, **policies))
    if config.local_cpu:
        # page-locked on a CUDA host: the blend's copies of each layer to the GPU run
        # asynchronously, overlapping the previous layer's compute (blend/layerwise/cached_kv.py)
        pinned = device is not None and torch.device(device).type == "cuda"
        capacity = int(config.max_local_cpu_size * GB)
        tiers.append(MemoryTier("cpu", capacity, "cpu", copy_on_get, pin_memory=pinned, **policies))
    folder = disk_folder(config)
    if folder is not None and shard:
        folder = os.path.join(folder, shard)
    if folder is not None:
        if config.max_local_disk_size > 0:
            tiers.append(DiskTier(folder, int(config.max_local_disk_size * GB), fp, layout))
        else:
            logger.warning("local_disk=%r is ignored: max_local_disk_size is 0 GB", folder)
    remote = _remote(settings, fp, layout, shard)
    if remote is not None:
        tiers.append(remote)
    if not tiers:
        logger.warning("no segment store tier is enabled: every lookup will miss")
    index = _index(settings, instance_id, index_dir, create=True)
    store = TieredStore(tiers, index)
    logger.info("segment store tiers: %s", ", ".join(t.name for t in tiers) if tiers else "(none)")
    return store


def create_lookup(
    config: BlendConfig,
    *,
    instance_id: str = "default",
    index_dir: str | None = None,
    shard: str = "",
) -> SegmentLookup:
    """The scheduler's view of the worker's store: the index, plus Redis when configured.

    Cheap: it holds no tensors and never reads an entry (so it needs no shared secret), and it
    never creates the index folder (the worker's store does). ``shard`` selects the Redis namespace
    of one tensor-parallel rank (see :func:`create_store`).
    """
    settings = store_settings(config)
    remote = _remote(settings, None, None, shard)
    return SegmentLookup(_index(settings, instance_id, index_dir, create=False), remote)


def create_shared_tier(config: BlendConfig, shard: str = "") -> Tier | None:
    """The shared tier alone (None without ``remote_url``), for presence checks: it holds no
    fingerprint, so it is not meant to load entries."""
    return _remote(store_settings(config), None, None, shard)
