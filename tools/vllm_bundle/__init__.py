"""The vLLM runtime bundle: vLLM 0.26.0's released Python files and the start-up dependencies its
CUDA engine needs, for a GPU machine that has torch, Triton and transformers but no vLLM and no
network, and accepts at most 64 MiB of extra files. Built here from PyPI, carried there,
unpacked by ``lmcache-backend hardware-check --steps vllm`` into a temporary folder that only its
children see (``lmcache_backend/hardware/vllm_bundle.py``).

Modules:

- ``spec``: the release, the pinned dependencies, what the GPU machine has, what is left out;
- ``build``: the bundle (and the rehearsal's wheels) from PyPI, reproducibly, size-checked;
- ``standin/``: the two stand-ins for vLLM's compiled extensions the check's path imports;
- ``gpu_python``: the GPU machine's Python emulated here (a venv with only its distributions);
- ``cuda_on_cpu``: a stand-in for a CUDA GPU in one process, for the rehearsal;
- ``rehearse``: the rehearsal itself, the vLLM step's child run on CPU;
- ``cli``: ``tools/build_vllm_bundle.py``.
"""
