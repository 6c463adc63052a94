"""The name the vllm-ascend worker patch writes into vllm-ascend's installed worker
(:mod:`lmcache_backend.patches.vllm_ascend_worker`): ``from lmcache_backend.model_tracker import
ModelTracker``. A worker file patched by any version of this package imports it until the patch
is reverted, so this name stays where it is; the tracker itself lives in
:mod:`lmcache_backend.integration.vllm.model_tracker`."""

from lmcache_backend.integration.vllm.model_tracker import ENGINE_NAME, ModelTracker  # noqa: F401
