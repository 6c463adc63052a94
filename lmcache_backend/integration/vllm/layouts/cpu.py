"""vLLM's CPU attention cache: written through vLLM's own op, read through a derived map.

One layer's cache is ``[num_blocks, Hkv, block_size, 2*D]``, but the element order inside a
block depends on the CPU kernel path (``isa``: AMX, VEC, ...), which may pack keys for its matrix
units. The logical shape does not say where a token lives, so writes go through vLLM's own
cache-write op, and reads go through a map *derived from that op*: at start-up, known patterns
(the digits of each element's index) are written through the op into a scratch block and located
(:func:`derive_cpu_block_map`). Only vLLM 0.32's CPU build is supported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmcache_backend.integration.vllm.layouts.base import PagedLayout

logger = logging.getLogger(__name__)

# Digits of an element's index are written as 1..16: integers every fp16/bf16/fp32 holds exactly.
_DIGIT_BITS = 4


def cpu_kv_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views vLLM's CPU backend hands to its ops (``cpu_attn.py``)."""
    num_blocks, num_kv_heads, block_size, _ = cache.shape
    kv = cache.view(num_blocks, num_kv_heads, block_size * 2, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    return key_cache, value_cache


@dataclass(frozen=True)
class CpuBlockMap:
    """Where each element of a block lives.

    Attributes:
        key_offsets, value_offsets: ``[block_size, Hkv, D]`` int64 offsets into one block's
            flattened storage (``cache[b].reshape(-1)``).
    """

    key_offsets: torch.Tensor
    value_offsets: torch.Tensor


WriteOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def derive_cpu_block_map(
    write: WriteOp, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> CpuBlockMap:
    """Locate every K/V element of a block by writing index digits through the cache op.

    Element ``(t, h, d)`` has index ``i = (t * Hkv + h) * D + d``. For each 4-bit digit of
    ``i`` the op writes ``digit + 1`` for every element into block 1 of a 2-block scratch cache
    (block 0 must stay untouched), keys and values in separate passes; every nonzero position of
    block 1 then holds a digit of the index stored there.

    Raises:
        RuntimeError: the op wrote outside the block, dropped, duplicated or transformed
            elements (the map would be wrong; the message says which check failed).
    """
    shape = (2, num_kv_heads, block_size, 2 * head_dim)
    count = block_size * num_kv_heads * head_dim
    index = torch.arange(count, dtype=torch.int64).view(block_size, num_kv_heads, head_dim)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)
    num_digits = (max(1, (count - 1).bit_length()) + _DIGIT_BITS - 1) // _DIGIT_BITS
    offsets = {}
    for which in ("key", "value"):
        located = torch.zeros(shape[1] * shape[2] * shape[3], dtype=torch.int64)
        written = None
        for j in range(num_digits):
            digit = ((index >> (_DIGIT_BITS * j)) & 15) + 1
            pattern = digit.to(dtype)
            zeros = torch.zeros_like(pattern)
            cache = torch.zeros(shape, dtype=dtype)
            k_cache, v_cache = cpu_kv_views(cache)
            k, v = (pattern, zeros) if which == "key" else (zeros, pattern)
            write(k, v, k_cache, v_cache, slots)
            if bool(cache[0].ne(0).any()):
                raise RuntimeError("the CPU cache write op wrote into a block it was not given")
            flat = cache[1].reshape(-1).float()
            mask = flat.ne(0)
            if written is None:
                written = mask
            elif not torch.equal(written, mask):
                raise RuntimeError("the CPU cache write op placed elements inconsistently")
            found = flat[mask]
            if found.ne(found.round()).any() or found.lt(1).any() or found.gt(16).any():
                raise RuntimeError("the CPU cache write op transformed the values it stored")
            located[mask] += (found.long() - 1) << (_DIGIT_BITS * j)
        positions = torch.nonzero(written, as_tuple=False).flatten()
        if positions.numel() != count:
            raise RuntimeError(
                f"the CPU cache write op stored {positions.numel()} {which} elements, "
                f"expected {count}"
            )
        table = torch.full((count,), -1, dtype=torch.int64)
        table[located[positions]] = positions
        if bool(table.lt(0).any()):
            raise RuntimeError(f"some {which} elements were not found after the write")
        offsets[which] = table.view(block_size, num_kv_heads, head_dim)
    return CpuBlockMap(offsets["key"], offsets["value"])


class CpuLayout(PagedLayout):
    """vLLM's CPU attention cache ``[num_blocks, Hkv, block_size, 2*D]``.

    Args:
        write_op: ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (or the release's equivalent).
        isa: the attention layers' kernel path (``layer.isa``).
        k_scale, v_scale, kv_cache_dtype: forwarded to the op (``"auto"`` caches only).
        num_kv_heads, block_size, head_dim, dtype: the cache geometry.
    """

    def __init__(
        self,
        write_op: Callable,
        isa: str,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if kv_cache_dtype != "auto":
            raise ValueError(f"CacheBlend needs an unquantized KV cache, got {kv_cache_dtype!r}")
        self.block_size = block_size
        self._op = write_op
        self._isa = isa
        self._scales = (k_scale, v_scale, kv_cache_dtype)
        self.map = derive_cpu_block_map(
            self._write_views, num_kv_heads, block_size, head_dim, dtype
        )
        logger.info(
            "CPU KV cache layout derived through the cache-write op (isa=%s, block_size=%d)",
            isa,
            block_size,
        )

    def _write_views(self, k, v, k_cache, v_cache, slots) -> None:
        k_scale, v_scale, cache_dtype = self._scales
        self._op(
            k,
            v,
            k_cache,
            v_cache,
            slots,
            self._isa,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_cache_dtype=cache_dtype,
        )

    def write(self, cache, keys, values, slots) -> None:
        k_cache, v_cache = cpu_kv_views(cache)
        self._write_views(
            keys.to(cache.dtype).contiguous(),
            values.to(cache.dtype).contiguous(),
            k_cache,
            v_cache,
            slots.to(torch.int64),
        )

    def read(self, cache, slots):
        flat = cache.view(cache.shape[0], -1)
        blocks = (slots // self.block_size).to(torch.int64)
        offsets = (slots % self.block_size).to(torch.int64)
        rows = blocks[:, None, None]
        keys = flat[rows, self.map.key_offsets[offsets]]
        values = flat[rows, self.map.value_offsets[offsets]]
        return keys, values
