"""What the vLLM runtime bundle holds: one vLLM release's Python files and the start-up
dependencies its CUDA engine imports that the GPU test machine lacks, each pinned.

The GPU test machine has Python 3.12, torch 2.11.0 (CUDA 13), Triton 3.6.0, transformers 5.17.0
and pytest, with their dependencies (:data:`GPU_MACHINE`, resolved by pip for cp312
manylinux), and no network. vLLM 0.20-0.26 pin torch 2.11.0, so 0.26.0's Python runs on it
as released; its compiled extensions are replaced by the stand-ins in ``standin/``.

:data:`DEPENDENCIES` is what ``LLM(...)`` with the check's settings imports beyond
:data:`GPU_MACHINE`, found by the CPU rehearsal (a venv holding only the GPU machine's
distributions: ``gpu_python.py``) and pinned to releases that satisfy vLLM 0.26.0's
requirements. vLLM's other requirements (FlashInfer, the CUTLASS DSL, OpenCV, mistral-common,
OpenTelemetry, ...) are imported only by paths the check does not take, or lazily.
"""

from __future__ import annotations

VLLM_VERSION = "0.26.0"
#: the CUDA wheel the bundle's Python files come from, and its sha256 (as recorded in
#: tests/fixtures/engine_contracts/vllm-0.26.0.json)
VLLM_WHEEL = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
VLLM_SHA256 = "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de"

#: the GPU machine's interpreter, which the bundle's compiled wheels are built for
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)

#: vLLM's start-up dependencies beyond the GPU machine's, pinned (name==version, PyPI names)
DEPENDENCIES = (
    # the engine's processes, messages and serialization
    "cloudpickle==3.1.3",
    "cbor2==6.3.0",
    "msgspec==0.23.0",
    "pyzmq==27.3.0",
    "psutil==7.2.2",
    "uvloop==0.23.0",
    "pybase64==1.5.1",
    "cachetools==8.0.2",
    "py-cpuinfo==9.0.0",
    "prometheus-client==0.26.0",
    "einops==0.8.2",
    # multimodal inputs (vllm.multimodal is imported at start) and the kernel warm-up, which
    # imports the MiniMax-M3 model and with it torchvision (built for torch 2.11.0, as vLLM pins)
    "pillow==13.0.0",
    "torchvision==0.26.0",
    # HTTP clients the entrypoints import
    "requests==2.34.2",
    "urllib3==2.8.0",
    "charset-normalizer==3.5.3",
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "attrs==26.1.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
    "openai==2.54.0",
    "distro==1.9.0",
    "jiter==0.19.0",
    "sniffio==1.3.1",
    "openai-harmony==0.0.8",
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "partial-json-parser==0.2.1.1.post7",
    # structured outputs (the sampler imports their backends' modules)
    "xgrammar==0.2.7",  # the newest that takes the apache-tvm-ffi vLLM pins (0.2.8: >=0.1.11)
    "apache-tvm-ffi==0.1.10",
    "llguidance==1.7.6",
)

#: what the GPU test machine has: pip's resolution of torch 2.11.0's own requirements (not its
#: CUDA libraries), triton 3.6.0, transformers 5.17.0 and pytest for cp312 manylinux
GPU_MACHINE = (
    "torch==2.11.0",
    "triton==3.6.0",
    "transformers==5.17.0",
    "pytest==9.2.0",
    "annotated-doc==0.0.7",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "certifi==2026.10.19.post1",
    "click==8.5.1",
    "filelock==4.3.2",
    "fsspec==2026.9.0",
    "h11==0.16.0",
    "hf-xet==1.8.0",
    "httpcore==1.0.9",
    "httpx==0.29.0",
    "huggingface-hub==1.33.0",
    "idna==3.21",
    "iniconfig==2.3.1",
    "jinja2==3.1.6",
    "markdown-it-py==4.3.0",
    "markupsafe==3.0.4",
    "mdurl==0.1.2",
    "mpmath==1.3.0",
    "networkx==3.7",
    "numpy==2.5.5",
    "packaging==26.4",
    "pluggy==1.7.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pygments==2.21.0",
    "pyyaml==6.0.4",
    "regex==2026.12.2",
    "rich==15.0.0",
    "safetensors==0.8.0",
    "setuptools==81.0.0",
    "shellingham==1.5.4",
    "sympy==1.14.0",
    "tokenizers==0.23.3",
    "tqdm==4.70.1",
    "typer==0.29.2",
    "typing-extensions==4.16.0",
    "typing-inspection==0.4.5",
)

#: built for the GPU machine's torch only: the CPU rehearsal (another torch) goes without it
GPU_TORCH_ONLY = ("torchvision",)

#: parts of the wheel the bundle leaves out: compiled extensions (CUDA kernels: the
#: stand-ins replace the two the check's path imports), CUDA/C++ sources, the Rust front-end
SKIPPED_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")
SKIPPED_FILES = ("vllm/vllm-rs",)

#: the stand-ins (this folder's ``standin/``) and where they go in the vllm package
STAND_INS = {
    "_C_stable_libtorch.py": "vllm/_C_stable_libtorch.py",
    "vllm_flash_attn/_vllm_fa2_C.py": "vllm/vllm_flash_attn/_vllm_fa2_C.py",
}

#: what the device tool carries into the GPU machine, all paths together
CARRY_LIMIT = 64 << 20


def name_of(pin: str) -> str:
    """The distribution's name in ``name==version``."""
    return pin.split("==", 1)[0]
