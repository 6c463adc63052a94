"""File patches for upstream packages, installed as ``lmcache_backend.patches``.

Each module patches one upstream symbol and says at its top why, how, for which upstream versions,
and when it can be removed. Nothing here runs at ``pip install`` time.
"""
