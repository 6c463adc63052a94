"""The package's version, written here only: ``setup.py`` reads it from this file and
``lmcache_backend.__version__`` imports it."""

__version__ = "0.1.0"
