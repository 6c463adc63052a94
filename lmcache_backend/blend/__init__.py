"""CacheBlend under LMCache's names.

* :class:`LMCBlender`, :class:`LMCBlenderBuilder` (``lmcache.v1.compute.blend``): the layerwise
  blender used by the engines; it blends a :class:`BlendRequest` into a :class:`KVTarget` (an
  engine's cache) and returns a :class:`BlendResult`.
* :class:`CacheBlendImpl`, :class:`SPTBlendRetriever`, :class:`BlendOutput`,
  :class:`BlendRetrieverResult` (``lmcache.blend``): the per-layer executor and retriever API.
"""

from lmcache_backend.blend.blender import LMCBlender, LMCBlenderBuilder
from lmcache_backend.blend.engine_side import KVLayerWriter, KVTarget
from lmcache_backend.blend.executor import CacheBlendImpl, indices_to_mask, mask_to_indices
from lmcache_backend.blend.interfaces import (
    BlendExecutor,
    BlendOutput,
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
)
from lmcache_backend.blend.request import BlendMetadata, BlendRequest, BlendResult
from lmcache_backend.blend.segments.retriever import SPTBlendRetriever, SPTBlendRetrieverTask
from lmcache_backend.blend.segments.segment_cache import SegmentCache

__all__ = [
    "BlendExecutor",
    "BlendMetadata",
    "BlendOutput",
    "BlendRequest",
    "BlendResult",
    "BlendRetriever",
    "BlendRetrieverResult",
    "BlendRetrieverTask",
    "CacheBlendImpl",
    "KVLayerWriter",
    "KVTarget",
    "LMCBlender",
    "LMCBlenderBuilder",
    "SPTBlendRetriever",
    "SPTBlendRetrieverTask",
    "SegmentCache",
    "indices_to_mask",
    "mask_to_indices",
]
