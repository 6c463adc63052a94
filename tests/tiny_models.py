"""The tiny random-weight models, from :mod:`lmcache_backend.data.tiny_models` (the hardware
check writes them at run time, so the writer lives in the package)."""

from lmcache_backend.data.tiny_models import SPECS, build_tiny_model

__all__ = ["SPECS", "build_tiny_model"]
