"""Tensor parallelism: every rank must keep the same tokens.

Each rank sees only its KV heads, so its token scores differ from the other ranks'. Scores are
summed over ranks before choosing; the ranks then run the same collectives with the same shapes.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lmcache_backend.ops import Ops
from lmcache_backend.ops.reference import kv_deviation_topk


def consistent_ops(ops: Ops) -> Ops:
    """``ops`` whose check-layer selection (``kv_deviation_topk``) agrees across ranks: the
    per-token deviations are summed over ranks first."""
    from vllm.distributed.parallel_state import get_tp_group

    def topk(k_fresh, k_cached, valid_mask, ratio, num_reusable=None):
        n = k_fresh.shape[0]
        dev = (k_fresh.float().reshape(n, -1) - k_cached.float().reshape(n, -1)).pow(2).sum(-1)
        dev = get_tp_group().all_reduce(dev)
        root = dev.clamp_min(0).sqrt()[:, None]
        return kv_deviation_topk(root, torch.zeros_like(root), valid_mask, ratio, num_reusable)

    return replace(ops, kv_deviation_topk=topk)


def rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank; 0 without asking vLLM when there is one rank, so a
    single-GPU worker path runs (and is tested) where vLLM's distributed state does not exist."""
    if tp_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def summed_over_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Token scores ``[N]`` summed over tensor-parallel ranks (each rank sees only its heads)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().all_reduce(scores.float().contiguous())
