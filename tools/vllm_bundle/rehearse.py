"""The CPU rehearsal: the vLLM step's child (``lmcache_backend.hardware.vllm_engine``) run in
this process with a CPU standing in for the GPU (``cuda_on_cpu``), a tiny Llama and short prompts.

Run it in the rehearsal venv with the bundle unpacked on ``PYTHONPATH``, as
``tests/tools/test_vllm_bundle_rehearsal.py`` and ``make vllm-rehearsal`` do:
``python tools/vllm_bundle/rehearse.py --json FILE [--sizes 400 --repeats 1]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_bundle import cuda_on_cpu  # noqa: E402

if __name__ == "__main__":
    cuda_on_cpu.install()
    from lmcache_backend.hardware import vllm_engine

    argv = sys.argv[1:]
    if "--shape" not in argv:
        argv = ["--shape", "tiny", *argv]
    code = vllm_engine.main(argv)
    print("stood in for:", ", ".join(cuda_on_cpu.STOOD_IN) or "nothing beyond the device")
    sys.exit(code)
