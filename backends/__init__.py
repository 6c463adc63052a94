"""Device backends, installed as ``lmcache_backend.backends``: one package per platform."""
