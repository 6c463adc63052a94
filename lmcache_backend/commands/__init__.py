"""The ``lmcache-backend`` commands that are not a package of their own: ``doctor``, ``verify``."""
