"""Ascend backend: the CacheBlend ops on torch-npu (installed as
``lmcache_backend.backends.ascend``)."""

from __future__ import annotations

from lmcache_backend.ops import BackendUnavailable


def load() -> dict:
    """Return the ops this backend implements; raise :class:`BackendUnavailable` if it cannot run."""
    raise BackendUnavailable("the Ascend backend has no ops yet")
