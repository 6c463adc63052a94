"""CUDA backend: Triton kernels for the CacheBlend ops (installed as
``lmcache_backend.backends.cuda``)."""

from __future__ import annotations

from lmcache_backend.ops import BackendUnavailable


def load() -> dict:
    """Return the ops this backend implements; raise :class:`BackendUnavailable` if it cannot run."""
    raise BackendUnavailable("the CUDA backend has no kernels yet")
