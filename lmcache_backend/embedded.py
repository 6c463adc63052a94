"""Moved to :mod:`lmcache_backend.data.embedded`; this name stays for code that imports it."""

from lmcache_backend.data.embedded import (  # noqa: F401
    EMBEDDED_MODEL_NAME,
    embedded_gguf_path,
    embedded_model_path,
    load_embedded_model,
)
