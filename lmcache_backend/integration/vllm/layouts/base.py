"""What every paged layout shares: slots and the write/read interface.

A token's *slot* is ``block_id * block_size + offset`` in the scheduler's blocks
(``vllm_config.cache_config.block_size``), the numbers vLLM's block table holds.
"""

from __future__ import annotations

import torch

#: One layer's paged cache as vLLM hands it to ``register_kv_caches``: a tensor (CUDA wheels,
#: CPU), or a ``(k_cache, v_cache)`` tuple (a ``[k, v]`` list in vllm-ascend 0.9).
LayerCache = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]


def slots_for(block_ids: list[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """``[stop - start]`` int64 slots of token positions ``start..stop-1`` of a request."""
    pos = torch.arange(start, stop, dtype=torch.int64)
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)[pos // block_size]
    return blocks * block_size + pos % block_size


class PagedLayout:
    """Interface: write/read one layer's K/V rows by slot.

    Attributes:
        block_size: the scheduler's block size, the unit of the slots the layout takes.
    """

    block_size: int

    def write(
        self, cache: LayerCache, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """``keys``, ``values``: ``[T, Hkv, D]``; ``slots``: ``[T]`` int64 (any device)."""
        raise NotImplementedError

    def read(self, cache: LayerCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, Hkv, D]`` keys and values at ``slots`` (``[T]``, any device)."""
        raise NotImplementedError

    def kernel_block_table(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The request's scheduler blocks ``block_ids [nb]`` as the blocks the attention
        kernel reads; only layouts whose kernels read block tables have one."""
        raise NotImplementedError(f"{type(self).__name__} has no kernel block table")
