"""Where the serving engine's loaded model is recorded, per engine instance.

The vLLM plugin (and the vllm-ascend worker patch) call :meth:`ModelTracker.register_model` right
after the worker loads its model; the connector looks the model up here. Registering the same
model twice is harmless.
"""

from __future__ import annotations

import threading
from typing import Any

ENGINE_NAME = "vllm-instance"


class ModelTracker:
    """A process-wide map ``instance_id -> model``."""

    _models: dict[str, Any] = {}
    _lock = threading.Lock()

    @classmethod
    def register_model(cls, instance_id: str, model: Any) -> None:
        """Record ``model`` for ``instance_id`` (replaces an earlier registration).

        When LMCache is installed the model is also registered in LMCache's
        ``VLLMModelTracker`` under LMCache's engine name, so LMCache's own blender finds it.
        """
        with cls._lock:
            cls._models[instance_id] = model
        _register_with_lmcache(model)

    @classmethod
    def get_model(cls, instance_id: str = ENGINE_NAME) -> Any:
        """Return the model registered for ``instance_id``.

        Raises:
            KeyError: nothing was registered (the vLLM plugin or the worker patch did not run).
        """
        with cls._lock:
            if instance_id not in cls._models:
                raise KeyError(
                    f"no model registered for instance {instance_id!r}: is the lmcache_backend "
                    "vLLM plugin installed, or the vllm-ascend worker patch applied?"
                )
            return cls._models[instance_id]

    @classmethod
    def has_model(cls, instance_id: str = ENGINE_NAME) -> bool:
        with cls._lock:
            return instance_id in cls._models

    @classmethod
    def unregister_model(cls, instance_id: str) -> None:
        with cls._lock:
            cls._models.pop(instance_id, None)


def _register_with_lmcache(model: Any) -> bool:
    """Register ``model`` in LMCache's tracker if LMCache is importable; returns whether it was."""
    try:
        from lmcache.integration.vllm.utils import ENGINE_NAME as LMCACHE_ENGINE_NAME
        from lmcache.v1.compute.models.utils import VLLMModelTracker
    except ImportError:
        return False
    VLLMModelTracker.register_model(LMCACHE_ENGINE_NAME, model)
    return True
