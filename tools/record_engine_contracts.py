#!/usr/bin/env python3
"""Record what each vLLM / vllm-ascend release hands a KV connector, from the released packages.

The work is done by the ``engine_contracts`` package next to this script; see its docstring and
``tests/fixtures/engine_contracts/README.md``.

Usage::

    python tools/record_engine_contracts.py                  # every release in releases.py
    python tools/record_engine_contracts.py --only vllm==0.32.0 --only vllm-ascend==0.18.0
    python tools/record_engine_contracts.py --wheel-dir DIR  # local wheels / sdists, no download

Only the standard library is needed.
"""

import sys

from engine_contracts import main

if __name__ == "__main__":
    sys.exit(main())
