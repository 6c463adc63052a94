"""vLLM's paged caches on CUDA and Ascend, written and read as K/V views ``[NB, BS, H, D]``.

Every cache form the CUDA wheels (FLASH_ATTN, FLASHINFER, TRITON_ATTN) and vllm-ascend hand to
``register_kv_caches`` keeps one token's head vector contiguous (``D`` innermost), so each form
has a pair of *views* ``key_cache``/``value_cache`` ``[num_blocks, block_size, H, D]`` whose
strides point exactly where the backend reads (``NB`` blocks of ``BS`` tokens as the cache
counts them, ``H`` KV heads, ``D`` head dim):

* ``[2, NB, BS, H, D]`` (:data:`KV_FIRST`): ``kv_cache.unbind(0)``.
* ``[NB, 2, BS, H, D]`` (:data:`BLOCK_FIRST`): ``kv_cache.unbind(1)``; FlashInfer's
  ``permute(*stride_order)`` is the same memory seen as ``[NB, 2, BS|H, H|BS, D]``.
* ``[NB, H, BS, 2*D]`` (:data:`PACKED`): ``kv_cache.transpose(1, 2).split(D, dim=-1)``: K is
  the first ``D`` features of each token's row, V the last ``D``.
* ``(k_cache, v_cache)`` (:data:`PAIR`), each ``[NB, BS, H, D]``: vllm-ascend.

NHD and HND (and the 0.29+ ``KVCacheLayout`` orders) differ only in the strides of these views,
so one view serves both: the op registry's ``paged_kv_write``/``paged_kv_read`` take them (the
torch reference and the Triton kernels take any block, slot and head strides with a contiguous
last dim; the Ascend ops take the contiguous pair vllm-ascend allocates).

Kernel blocks: from vLLM 0.11.2 a backend may split each scheduler block of ``block_size``
tokens into ``r = block_size // BS`` kernel blocks of ``BS`` tokens, and the cache handed over
may count kernel blocks. vLLM numbers kernel block ``j`` of scheduler block ``b`` as
``b * r + j`` (its kernel block table is ``block_id * r + arange(r)``; vllm-ascend 0.11-0.23:
``BlockTable._convert_physical_to_logical_blocks``, the same) and lays kernel blocks out at one
constant stride (a block's memory split in ``r``), so the token at offset ``o`` of block ``b``
sits in kernel block ``b * r + o // BS`` at row ``o % BS``, and
``(b * r + o // BS) * BS + o % BS == b * block_size + o``: the scheduler's slot *is* the kernel
slot. The views therefore take slots as they are, with the cache's own block size ``BS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmcache_backend.integration.vllm.layouts.base import LayerCache, PagedLayout
from lmcache_backend.ops import Ops

KVViews = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CacheForm:
    """One way a layer's cache is handed over.

    Attributes:
        name: short name for logs and messages.
        shape: the handed-over logical shape, symbolically.
        views: ``(cache, head_dim) -> (key_cache, value_cache)``, each ``[NB, BS, H, D]``,
            views of the cache's own memory.
    """

    name: str
    shape: str
    views: Callable[[LayerCache, int], KVViews]


def _kv_first(cache: LayerCache, head_dim: int) -> KVViews:
    return cache[0], cache[1]


def _block_first(cache: LayerCache, head_dim: int) -> KVViews:
    return cache[:, 0], cache[:, 1]


def _packed(cache: LayerCache, head_dim: int) -> KVViews:
    # [NB, H, BS, 2D] -> [NB, BS, H, 2D]: K is C[:D] and V is C[D:] of each token's row, the
    # split FLASH_ATTN, FLASHINFER and TRITON_ATTN write and read with from 0.26.
    rows = cache.transpose(1, 2)
    return rows[..., :head_dim], rows[..., head_dim:]


def _pair(cache: LayerCache, head_dim: int) -> KVViews:
    return cache[0], cache[1]


KV_FIRST = CacheForm("kv-first", "[2, NB, BS, H, D]", _kv_first)
BLOCK_FIRST = CacheForm("block-first", "[NB, 2, BS, H, D]", _block_first)
PACKED = CacheForm("packed", "[NB, H, BS, 2*D]", _packed)
PAIR = CacheForm("pair", "(k_cache, v_cache) each [NB, BS, H, D]", _pair)


class DeviceLayout(PagedLayout):
    """Writes and reads one layer's rows through the K/V views of its cache form.

    Args:
        form: how the cache was handed over.
        head_dim: ``D``.
        block_size: the scheduler's block size (the slots' unit).
        kernel_block_size: the cache's own block size ``BS`` (divides ``block_size``).
        ops: the op registry whose ``paged_kv_write``/``paged_kv_read`` move the rows.
        memory: the memory order recognised (``NHD``, ``HND``, ``LBNHC``, ...), for logs.
        backend: the attention backend's name, for logs.
    """

    def __init__(
        self,
        form: CacheForm,
        head_dim: int,
        block_size: int,
        kernel_block_size: int,
        ops: Ops,
        memory: str = "",
        backend: str | None = None,
    ) -> None:
        self.form = form
        self.head_dim = head_dim
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.ops = ops
        self.memory = memory
        self.backend = backend

    def views(self, cache: LayerCache) -> KVViews:
        """``(key_cache, value_cache)``, each ``[NB, BS, H, D]``, of one layer's cache."""
        return self.form.views(cache, self.head_dim)

    def write(self, cache, keys, values, slots) -> None:
        k_cache, v_cache = self.views(cache)
        self.ops.paged_kv_write(keys, values, k_cache, v_cache, slots.to(k_cache.device))

    def read(self, cache, slots):
        k_cache, v_cache = self.views(cache)
        return self.ops.paged_kv_read(k_cache, v_cache, slots.to(k_cache.device))

    def kernel_block_table(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The request's scheduler blocks ``block_ids [nb]`` as the cache's own blocks
        ``[nb * r]`` (``r = block_size / kernel_block_size``): scheduler block ``b`` holds kernel
        blocks ``b * r .. b * r + r - 1``, in order."""
        ratio = self.block_size // self.kernel_block_size
        if ratio == 1:
            return block_ids
        within = torch.arange(ratio, dtype=block_ids.dtype, device=block_ids.device)
        return (block_ids[:, None] * ratio + within[None, :]).flatten()

    def attention(
        self,
        cache: LayerCache,
        q: torch.Tensor,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        *,
        key_end: int | None = None,
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at sorted ``positions [N]`` over one request's rows of ``cache``,
        read through its block table (``block_table``: :meth:`kernel_block_table` of the
        request's blocks, on the cache's device), by the op registry's
        ``paged_attention_at_positions`` -> ``[N, Hq, D]``. ``key_end``: a bound on every
        query's position + 1 that the table covers (None: the op reads the positions back to
        check)."""
        k_cache, v_cache = self.views(cache)
        return self.ops.paged_attention_at_positions(
            q, k_cache, v_cache, block_table, positions.to(k_cache.device), scale, key_end=key_end
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        blocks = (
            f"blocks of {self.block_size} tokens"
            if self.kernel_block_size == self.block_size
            else f"kernel blocks of {self.kernel_block_size} tokens inside scheduler blocks "
            f"of {self.block_size}"
        )
        return (
            f"{self.form.shape} ({self.form.name}, {self.memory or 'memory order not checked'}; "
            f"backend {self.backend or 'not named'}), {blocks}"
        )
