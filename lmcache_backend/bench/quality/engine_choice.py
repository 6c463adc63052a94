"""The benchmark's engines by name: ``create_engine("hf" | "vllm", model=...)``, on the embedded
model unless another is named."""

from __future__ import annotations

import importlib.util

from lmcache_backend.bench.quality.engines import BenchEngine
from lmcache_backend.integration.vllm import CONNECTOR_MODULE

ENGINE_CHOICES = ("hf", "vllm")


class EngineUnavailable(RuntimeError):
    """The requested engine cannot run here; the message says what is missing."""


VLLM_CONNECTOR_MODULE = CONNECTOR_MODULE


def vllm_engine_problem() -> str | None:
    """Why ``--engine vllm`` cannot run here, or None when its pieces are importable."""
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vLLM (this package's [cuda], [cpu] or [ascend] extra)")
    try:
        connector = importlib.util.find_spec(VLLM_CONNECTOR_MODULE)
    except ModuleNotFoundError:
        connector = None
    if connector is None:
        missing.append(f"the vLLM connector module {VLLM_CONNECTOR_MODULE}")
    if missing:
        return "--engine vllm needs " + " and ".join(missing) + "; use --engine hf"
    return None


def create_engine(name: str, config=None, model: str | None = None) -> BenchEngine:
    """The engine called ``name`` on ``model``: a folder, a hub name or an embedded model's
    name (``gemma3-270m``); None: the default embedded model.

    Raises:
        EngineUnavailable: the engine's packages, or the named embedded model's, are missing
            (the message says which).
    """
    if name not in ENGINE_CHOICES:
        raise EngineUnavailable(
            f"unknown engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}"
        )
    from lmcache_backend.data.embedded import model_label, resolve_model

    if name == "vllm":
        problem = vllm_engine_problem()
        if problem:
            raise EngineUnavailable(problem)
    try:
        path = resolve_model(model)
    except FileNotFoundError as exc:
        raise EngineUnavailable(str(exc)) from None
    if name == "hf":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lmcache_backend.bench.quality.hf_engine import HFEngine

        tokenizer = AutoTokenizer.from_pretrained(path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return HFEngine(hf_model, tokenizer, config, model_name=model_label(model))
    from lmcache_backend.bench.quality.vllm_engine import VLLMEngine

    return VLLMEngine(path, model_label(model))
