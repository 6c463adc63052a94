"""CacheBlend under LMCache's names.

* :class:`LMCBlender`, :class:`LMCBlenderBuilder` (``lmcache.v1.compute.blend``): the layerwise
  blender used by the engines.
* :class:`CacheBlendImpl`, :class:`SPTBlendRetriever`, :class:`BlendOutput`,
  :class:`BlendRetrieverResult` (``lmcache.blend``): the per-layer executor and retriever API.
"""

from lmcache_backend.blend.blender import (
    BlendMetadata,
    BlendResult,
    KVLayerWriter,
    LMCBlender,
    LMCBlenderBuilder,
)
from lmcache_backend.blend.executor import CacheBlendImpl, indices_to_mask, mask_to_indices
from lmcache_backend.blend.interfaces import (
    BlendExecutor,
    BlendOutput,
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
)
from lmcache_backend.blend.retriever import SPTBlendRetriever, SPTBlendRetrieverTask
from lmcache_backend.blend.segment_cache import SegmentCache

__all__ = [
    "BlendExecutor",
    "BlendMetadata",
    "BlendOutput",
    "BlendResult",
    "BlendRetriever",
    "BlendRetrieverResult",
    "BlendRetrieverTask",
    "CacheBlendImpl",
    "KVLayerWriter",
    "LMCBlender",
    "LMCBlenderBuilder",
    "SPTBlendRetriever",
    "SPTBlendRetrieverTask",
    "SegmentCache",
    "indices_to_mask",
    "mask_to_indices",
]
