"""What the scheduler-side connector tells the workers each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache_backend.config import BlendConfig


@dataclass
class LoadSpec:
    """Blend one request's prompt into its blocks before this step's forward pass.

    Attributes:
        req_id: vLLM's request id.
        token_ids: the prompt, ``T`` ids.
        block_ids: the request's blocks (first KV-cache group), covering tokens ``0..T-1``.
        prefix_len: tokens ``0..prefix_len-1`` already hold vLLM's own K/V (prefix-cache hit).
        end: the connector provides tokens ``prefix_len..end-1``; vLLM computes the rest.
        config: this request's settings, its ``kv_transfer_params`` applied to the engine's and
            checked (:func:`~lmcache_backend.integration.vllm.settings.request_config`); None:
            the engine's.
        sliced: an asynchronous load (``blend_layers_per_step > 0``): the blend starts this
            step and advances a fixed number of layer passes per step; vLLM allocated blocks
            for tokens ``0..end-1`` only, and schedules the request once the worker reports it
            in ``finished_recving``.
        cache_salt: the request's ``cache_salt`` (``Request.cache_salt``): the blend reuses
            only segments stored under this salt; ``None``: unsalted ones.
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    prefix_len: int
    end: int
    config: BlendConfig | None = None
    sliced: bool = False
    cache_salt: str | None = None


@dataclass
class SaveSpec:
    """Store the segments of a prompt whose K/V are all in the paged cache after this step,
    under the request's ``cache_salt`` (``None``: unsalted); with ``probes`` > 0 (a staleness
    probe) measure the stored segments it holds instead, each entry getting its prior after
    ``probes`` probes."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    cache_salt: str | None = None
    probes: int = 0


@dataclass
class CacheBlendMetadata:
    """The step's plan. ``cancels``: requests finished (aborted) while their sliced blend may be
    in flight: the workers drop it before advancing any slice, so nothing writes their blocks
    again, and report them in ``finished_recving`` (vLLM frees the blocks of a request aborted
    in WAITING_FOR_REMOTE_KVS only then)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
