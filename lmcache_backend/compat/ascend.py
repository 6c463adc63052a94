"""The vllm-ascend releases the integration knows, from their recorded packages.

vllm-ascend is vLLM's NPU platform plugin: the connector API, the scheduler output and the models
are vLLM's (the release vllm-ascend pins), so the code path is the pinned vLLM's
(:mod:`lmcache_backend.compat.vllm`). vllm-ascend itself decides where KV transfer starts (its
``NPUWorker``), which runner loads the model (its ``NPUModelRunner``, V1, or the V2 one, which
inherits vLLM's V2 ``load_model``) and the KV-cache layout. Nothing here imports vllm-ascend.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_backend.compat.profile import KvCacheLayout
from lmcache_backend.compat.versions import nearest, release


@dataclass(frozen=True)
class AscendRelease:
    """One recorded vllm-ascend release (``tests/fixtures/engine_contracts/vllm_ascend-*.json``).

    Attributes:
        version: the vllm-ascend release as published.
        vllm: the vLLM release it pins (``pins.pinned_vllm``).
        kv_transfer_after_model_load: its worker starts KV transfer after ``load_model``.
        v2_runner: it ships a V2 ``NPUModelRunner`` (chosen by ``VLLM_USE_V2_MODEL_RUNNER``).
        supported: whether a code path serves it; ``note`` says why not.
    """

    version: str
    vllm: str
    kv_transfer_after_model_load: bool
    v2_runner: bool
    supported: bool = True
    note: str = ""


ASCEND_RELEASES: tuple[AscendRelease, ...] = (
    AscendRelease(
        "0.9.1",
        "0.9.1",
        kv_transfer_after_model_load=False,
        v2_runner=False,
        supported=False,
        note="its vLLM 0.9.1 hands connectors one CachedRequestData per request",
    ),
    AscendRelease("0.11.0", "0.11.0", kv_transfer_after_model_load=False, v2_runner=False),
    AscendRelease("0.13.0", "0.13.0", kv_transfer_after_model_load=False, v2_runner=True),
    AscendRelease("0.18.0", "0.18.0", kv_transfer_after_model_load=True, v2_runner=True),
    AscendRelease("0.23.0.post1", "0.23.0", kv_transfer_after_model_load=True, v2_runner=True),
)

#: The releases whose worker ``lmcache-backend apply-patch`` was checked against, oldest first:
#: every recorded one (``tests/patches/test_apply_patch.py`` patches each). An older worker
#: predates the V1 layout and is refused; a newer one is patched if its structure is understood.
PATCH_CHECKED: tuple[str, ...] = tuple(a.version for a in ASCEND_RELEASES)

#: What ``register_kv_caches`` receives on Atlas A2/A3 (ND format) in every supported release.
NPU_KV_CACHE_LAYOUT = KvCacheLayout(
    "AscendAttentionBackend",
    "ND",
    ("num_blocks", "block_size", "num_kv_heads", "head_size"),
    note="a (k_cache, v_cache) pair, each of this shape",
)


def ascend_release(version: str | None) -> AscendRelease | None:
    """The recorded release with the same release core as ``version`` (``0.23.0`` and
    ``0.23.0.post1`` are one), or None."""
    core = release(version)
    return next((a for a in ASCEND_RELEASES if release(a.version) == core), None)


def supported_ascend() -> list[AscendRelease]:
    return [a for a in ASCEND_RELEASES if a.supported]


def nearest_ascend(version: str) -> AscendRelease:
    """The supported release closest to ``version`` (ties: the newer)."""
    by_version = {a.version: a for a in supported_ascend()}
    return by_version[nearest(version, list(by_version))]
