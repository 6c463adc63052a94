"""``python -m lmcache_backend``: the ``lmcache-backend`` command."""

import sys

from lmcache_backend.cli import main

sys.exit(main())
