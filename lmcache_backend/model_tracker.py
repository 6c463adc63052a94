"""The name the vllm-ascend worker patch imports (:mod:`lmcache_backend.patches`); the tracker
lives in :mod:`lmcache_backend.integration.vllm.model_tracker`."""

from lmcache_backend.integration.vllm.model_tracker import ENGINE_NAME, ModelTracker  # noqa: F401
