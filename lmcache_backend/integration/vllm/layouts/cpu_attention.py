"""Attention of selected queries through vLLM's CPU paged-attention op (vLLM 0.32 CPU build)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_backend.integration.vllm.layouts.cpu import cpu_kv_views


@dataclass
class AttentionPlan:
    """vLLM CPU attention metadata for one set of query positions (see :class:`CpuAttention`)."""

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


class CpuAttention:
    """Attention of selected queries through vLLM's CPU paged-attention op, over the paged cache.

    Each run of consecutive query positions ``a..b`` is issued as one request of ``b - a + 1``
    queries and ``b + 1`` keys over the request's block table: vLLM's causal mask (aligned to
    the end of each request) then gives every query at position ``p`` exactly the keys
    ``0..p``, with no mask tensor; a full prefill is one run. The op reads the keys straight from
    the paged cache, so every key row must be written before the call.

    Args:
        isa: the attention layers' kernel path (``layer.isa``).
        num_heads, num_kv_heads, head_dim: this rank's attention geometry.
        dtype: the cache (and query) dtype.
        split_kv: ``VLLM_CPU_ATTN_SPLIT_KV``.
    """

    def __init__(
        self, isa: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype, split_kv: bool
    ) -> None:
        from vllm import _custom_ops

        self._ops = _custom_ops
        self.isa = isa
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.split_kv = split_kv

    @staticmethod
    def available() -> bool:
        """Whether this vLLM build has the CPU paged-attention op and its scheduler."""
        try:
            from vllm import _custom_ops
        except ImportError:
            return False
        return all(
            hasattr(_custom_ops, name)
            for name in ("cpu_attention_with_kv_cache", "cpu_attn_get_scheduler_metadata")
        )

    def plan(self, positions: torch.Tensor, block_ids: torch.Tensor) -> AttentionPlan:
        """Metadata for queries at sorted ``positions [N]`` of a request with ``block_ids``."""
        pos = positions.to("cpu", torch.int64)
        breaks = torch.nonzero(pos[1:] != pos[:-1] + 1, as_tuple=False).flatten() + 1
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), breaks, torch.tensor([pos.numel()])])
        query_start_loc = bounds.to(torch.int32)
        seq_lens = (pos[bounds[1:] - 1] + 1).to(torch.int32)
        runs = seq_lens.numel()
        table = block_ids.to(torch.int32)[None].expand(runs, -1).contiguous()
        meta = self._ops.cpu_attn_get_scheduler_metadata(
            num_reqs=runs,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            seq_lens=seq_lens,
            dtype=self.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=self.split_kv,
        )
        return AttentionPlan(pos, query_start_loc, seq_lens, table, meta)

    def __call__(
        self, cache: torch.Tensor, q: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at ``plan``'s positions -> ``[N, Hq, D]`` in the cache dtype."""
        q = q.to(self.dtype).contiguous()
        out = torch.empty_like(q)
        k_cache, v_cache = cpu_kv_views(cache)
        self._ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=k_cache,
            value_cache=v_cache,
            output=out,
            query_start_loc=plan.query_start_loc,
            seq_lens=plan.seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=plan.block_table,
            softcap=0.0,
            scheduler_metadata=plan.scheduler_metadata,
            s_aux=None,
        )
        return out
