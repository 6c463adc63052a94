#!/usr/bin/env python3
"""Build the vLLM runtime bundle for the GPU test machine (no vLLM, no network there), and the
CPU rehearsal's environment: see ``tools/vllm_bundle/__init__.py`` and ``docs/hardware.md``.

Usage::

    python tools/build_vllm_bundle.py                 # .cache/vllm-bundle/ (about 40 MiB)
    python tools/build_vllm_bundle.py --wheel PATH    # vLLM's CUDA wheel already downloaded
    python tools/build_vllm_bundle.py --rehearsal     # .cache/vllm-rehearsal/: venv + wheels
"""

import sys

from vllm_bundle.cli import main

if __name__ == "__main__":
    sys.exit(main())
