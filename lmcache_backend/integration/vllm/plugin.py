"""vLLM general plugin: record each worker's loaded model for the connector, without editing vLLM.

``register()`` runs in every vLLM process (entry point ``vllm.general_plugins``); it wraps
``load_model`` of every model runner the release may build on this platform (the code path's
``model_runners``: vLLM's V1 ``GPUModelRunner`` and, from 0.12, its V2 runner, a separate class, on
CUDA; ``CPUModelRunner`` on CPU; vllm-ascend's ``NPUModelRunner`` and vLLM's V2 runner, whose
``load_model`` vllm-ascend's V2 runner inherits, on NPU), so that, right after loading, the
runner's model (unwrapped from any CUDA-graph wrapper) is recorded in
:class:`~lmcache_backend.integration.vllm.model_tracker.ModelTracker`.
The plugin never refuses a release: it takes the code path the installed release would run,
tested or not (:func:`lmcache_backend.compat.gate.code_path`); the connector applies the version
gate when it starts. Wrapping is idempotent: a second ``register()`` changes nothing.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from lmcache_backend.integration.vllm.model_tracker import ENGINE_NAME, ModelTracker

logger = logging.getLogger(__name__)

_MARK = "__lmcache_backend_wrapped__"
_state = {"registered": False, "wrapped": []}


def underlying_model(runner: Any) -> Any:
    """The runner's model, unwrapped from CUDA-graph / micro-batch wrappers."""
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    seen = 0
    while hasattr(model, "unwrap") and seen < 4:  # CUDAGraphWrapper, UBatchWrapper
        model = model.unwrap()
        seen += 1
    return model


def _wrap(cls: type) -> bool:
    original = cls.__dict__.get("load_model")
    if original is None or getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        try:
            ModelTracker.register_model(ENGINE_NAME, underlying_model(self))
        except Exception as exc:  # recording must never break model loading
            logger.warning("CacheBlend could not record the loaded model: %s", exc)
        return out

    setattr(load_model, _MARK, True)
    cls.load_model = load_model
    return True


def install_hooks(runners: Any) -> list[str]:
    """Wrap ``load_model`` of each :class:`~lmcache_backend.compat.profile.Runner`; returns the
    wrapped ones. A runner whose module does not import here (the V2 runner of a build without
    it, vllm-ascend's runner off an NPU) is skipped: this process cannot build it either."""
    wrapped = []
    for runner in runners:
        try:
            cls = getattr(importlib.import_module(runner.module), runner.name)
        except (ImportError, AttributeError) as exc:
            logger.debug("CacheBlend plugin: %s not hooked: %s", runner.label, exc)
            continue
        if _wrap(cls):
            wrapped.append(f"{runner.label}.load_model")
    return wrapped


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call more than once."""
    if _state["registered"]:
        return
    _state["registered"] = True
    try:
        from lmcache_backend.compat.gate import code_path
        from lmcache_backend.device import engine_platform

        profile = code_path()
        if profile is not None:
            _state["wrapped"].extend(install_hooks(profile.runners(engine_platform())))
    except Exception as exc:  # a plugin failure must not stop vLLM; the connector reports it
        logger.warning("CacheBlend plugin hook not installed: %s", exc)
    try:
        from lmcache_backend.integration import lmcache as lmcache_integration

        lmcache_integration.maybe_install_from_plugin()
    except (ImportError, AttributeError):
        pass


def hook_status() -> dict[str, Any]:
    """What the plugin did in this process (for ``doctor``)."""
    return {
        "registered": _state["registered"],
        "wrapped": list(_state["wrapped"]),
        "model_recorded": ModelTracker.has_model(ENGINE_NAME),
    }
