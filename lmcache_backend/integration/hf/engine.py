"""A small serving loop over HF transformers: full prefill, CacheBlend prefill, greedy decoding.

This is the engine the demo and the benchmark drive on CPU; inside vLLM the connector plays its
role. Time to first token (TTFT) is measured from receiving the prompt's token ids to holding the
first generated token, store lookups included.

Tenants: every call that reads or writes the store takes a ``cache_salt``, as vLLM's requests
do: segments stored under one salt are reused only by requests of the same salt (``None``:
unsalted segments only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_backend.blend import BlendResult, LMCBlender
from lmcache_backend.blend.segments.patterns import segment_pattern
from lmcache_backend.blend.segments.segment_cache import SegmentCache
from lmcache_backend.config import BlendConfig, load_config
from lmcache_backend.models.hf import HFModelAdapter
from lmcache_backend.ops import Ops, get_ops
from lmcache_backend.storage import create_store
from lmcache_backend.storage.segments import SegmentStore

logger = logging.getLogger(__name__)


@dataclass
class Prefill:
    """A prompt's prefill: first-token logits and every layer's K/V.

    Attributes:
        logits: ``[vocab]`` fp32 logits after the last prompt token.
        keys, values: per layer ``[T, Hkv, D]``.
        ttft_s: seconds from token ids to the first token.
        blend: the blender's result when the prefill was blended.
    """

    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    ttft_s: float
    blend: BlendResult | None = None


@dataclass
class Generation:
    """A greedy generation: the prefill plus the generated ids and text."""

    prefill: Prefill
    token_ids: list[int]
    text: str


@torch.no_grad()
def hf_full_prefill(model: torch.nn.Module, token_ids: Sequence[int]) -> Prefill:
    """``model``'s own forward pass over ``token_ids``: last-token logits and per-layer
    ``[T, Hkv, D]`` K/V read from its cache."""
    from transformers import DynamicCache

    start = time.perf_counter()
    ids = torch.tensor([list(token_ids)], device=model.device)
    # a cache without the model's config keeps every row of every layer: one built from it
    # keeps only the last window of a sliding-window layer (Gemma 3), and every row is stored
    out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1].float()
    logits.argmax()
    ttft = time.perf_counter() - start
    cache = out.past_key_values
    keys = [layer.keys[0].transpose(0, 1) for layer in cache.layers]
    values = [layer.values[0].transpose(0, 1) for layer in cache.layers]
    return Prefill(logits, keys, values, ttft)


def kv_to_dynamic_cache(model: torch.nn.Module, keys, values, every_row: bool = False):
    """An HF ``DynamicCache`` holding per-layer ``[T, Hkv, D]`` K/V, ready for decoding.

    A cache built from the model's config keeps only the last window of a sliding-window layer
    (all decoding needs); ``every_row`` keeps every row, for a prefill that continues from it and
    whose K/V are read back whole (see :func:`hf_full_prefill`)."""
    from transformers import DynamicCache

    cache = DynamicCache() if every_row else DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(
            k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), layer
        )
    return cache


class HFBlendEngine:
    """Full and blended prefill plus greedy decoding for one HF model.

    Args:
        model: a ``transformers`` causal LM (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text).
        tokenizer: its tokenizer.
        config: CacheBlend settings (default: :func:`load_config` with blending enabled).
        store: the segment store (default: the tiers the configuration enables, see
            :func:`lmcache_backend.storage.create_store`).
        ops: op set (default: ``get_ops(config.backend)``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        config: BlendConfig | None = None,
        store: SegmentStore | None = None,
        ops: Ops | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or load_config(enable_blending=True)
        self.adapter = HFModelAdapter(model)
        self.config.validate_for_model(self.adapter.num_layers)
        self.ops = ops or get_ops(self.config.backend)
        if store is None:
            # One process serves and stores here: no cross-process index is needed, and the
            # retriever only reads entries, so hits need not be copied.
            extra = {"segment_index": False, "copy_on_get": False, **self.config.extra_config}
            store = create_store(
                self.config.replace(extra_config=extra),
                self.adapter.device,
                fingerprint=self.adapter.fingerprint,
                instance_id="hf",
            )
        self.store = store
        self.separator = segment_pattern(
            tokenizer,
            self.config.blend_special_str,
            self.config.blend_block_size,
            self.config.blend_segmentation,
        )
        self.segment_cache = SegmentCache(self.store, self.adapter.fingerprint, self.separator)
        self.blender = LMCBlender(
            self.store, None, self.config, self.adapter, self.separator, self.ops
        )
        from lmcache_backend.blend.segments.staleness_prior import ProbeAccumulator

        self._probes = ProbeAccumulator()
        self.stop_ids = {
            t
            for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
            if isinstance(t, int) and t >= 0
        }

    def request_config(self, ratios: Sequence[float] | None = None) -> BlendConfig:
        """The settings of a request with ``ratios`` (default: the configured ones)."""
        if ratios is None:
            return self.config
        return self.config.replace(blend_recompute_ratios=list(ratios))

    def full_prefill(self, token_ids: Sequence[int]) -> Prefill:
        """The model's own forward pass over the whole prompt (the quality reference)."""
        return hf_full_prefill(self.model, token_ids)

    @torch.no_grad()
    def blend_prefill(
        self,
        token_ids: Sequence[int],
        ratios: Sequence[float] | None = None,
        cache_salt: str | None = None,
    ) -> Prefill:
        """CacheBlend prefill with ``ratios`` (default: the configured ones), reusing the
        segments stored under ``cache_salt`` only."""
        start = time.perf_counter()
        config = self.request_config(ratios)
        result = self.blender.blend(list(token_ids), config=config, cache_salt=cache_salt)
        result.logits.argmax()
        ttft = time.perf_counter() - start
        return Prefill(result.logits, result.keys, result.values, ttft, blend=result)

    def store_prompt(
        self, token_ids: Sequence[int], prefill: Prefill, cache_salt: str | None = None
    ) -> int:
        """Store the segments of a computed prompt under ``cache_salt``; returns how many were
        new.

        After a full prefill every segment is stored. After a blended prefill only the segments
        that were not reused: they were computed fresh in every layer, the reused ones hold
        blended K/V.
        """
        tokens = list(token_ids)
        segments = self.segment_cache.salted(cache_salt)
        only = None
        if prefill.blend is not None and prefill.blend.blended:
            valid = prefill.blend.valid_mask
            cut = segments.segments(tokens)
            only = [seg for seg in cut if not bool(valid[seg.start : seg.end].any())]
        return segments.store_segments(tokens, prefill.keys, prefill.values, only)

    @torch.no_grad()
    def probe(self, token_ids: Sequence[int], probes: int, cache_salt: str | None = None) -> int:
        """A staleness probe: full prefill of ``token_ids``, measured against every stored
        segment it holds that was computed in another context; each entry gets its staleness
        prior after ``probes`` probes (:mod:`lmcache_backend.blend.segments.staleness_prior`).
        Nothing is stored. Returns the entries given a prior."""
        from lmcache_backend.blend.segments.staleness_prior import measure_probe

        tokens = list(token_ids)
        prefill = self.full_prefill(tokens)

        def rows_of(segment):
            rows = slice(segment.start, segment.end)
            return (
                torch.stack([k[rows] for k in prefill.keys]),
                torch.stack([v[rows] for v in prefill.values]),
            )

        cache = self.segment_cache.salted(cache_salt)
        return measure_probe(cache, tokens, rows_of, probes, self._probes, self.adapter, self.ops)

    def warm(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Full prefill of ``token_ids`` and store every segment under ``cache_salt``; returns
        the number stored."""
        return self.store_prompt(token_ids, self.full_prefill(token_ids), cache_salt)

    @torch.no_grad()
    def decode(self, token_ids: Sequence[int], prefill: Prefill, max_new_tokens: int) -> Generation:
        """Greedy decoding from a prefill's logits and K/V (HF's own model for each step)."""
        cache = kv_to_dynamic_cache(self.model, prefill.keys, prefill.values)
        generated: list[int] = []
        logits = prefill.logits
        for _ in range(max_new_tokens):
            next_id = int(logits.argmax())
            if next_id in self.stop_ids:
                break
            generated.append(next_id)
            ids = torch.tensor([[next_id]], device=self.adapter.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            logits = out.logits[0, -1].float()
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        return Generation(prefill=prefill, token_ids=generated, text=text)

    def generate(
        self,
        token_ids: Sequence[int],
        strategy: str = "blend",
        ratios: Sequence[float] | None = None,
        max_new_tokens: int = 32,
        cache_salt: str | None = None,
    ) -> Generation:
        """Prefill with ``strategy`` (``"full"`` or ``"blend"``, reusing ``cache_salt``'s
        segments) and decode greedily."""
        if strategy == "full":
            prefill = self.full_prefill(token_ids)
        elif strategy == "blend":
            prefill = self.blend_prefill(token_ids, ratios, cache_salt)
        else:
            raise ValueError(f"strategy must be 'full' or 'blend', got {strategy!r}")
        return self.decode(token_ids, prefill, max_new_tokens)
