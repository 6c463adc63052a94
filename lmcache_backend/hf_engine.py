"""Moved to :mod:`lmcache_backend.integration.hf.engine`; this name stays for code that imports
it."""

from lmcache_backend.integration.hf.engine import (  # noqa: F401
    Generation,
    HFBlendEngine,
    Prefill,
    hf_full_prefill,
)
