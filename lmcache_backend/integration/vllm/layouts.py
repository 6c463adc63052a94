"""Copy contiguous K/V rows to and from vLLM's paged KV cache, per attention backend.

A token's *slot* is ``block_id * block_size + offset``. Two layouts:

* **CUDA flash-attention** (:class:`FlashLayout`): one layer's cache is
  ``[2, num_blocks, block_size, Hkv, D]`` (or ``[num_blocks, 2, ...]``); the logical shape says
  where a token lives, so the op registry's ``paged_kv_write``/``paged_kv_read`` apply.
* **vLLM CPU** (:class:`CpuLayout`): one layer's cache is ``[num_blocks, Hkv, block_size, 2*D]``,
  but the element order inside a block depends on the CPU kernel path (``isa``: AMX, VEC, ...),
  which may pack keys for its matrix units. The logical shape does not say where a token lives,
  so writes go through vLLM's own cache-write op, and reads go through a map *derived from that
  op*: at start-up, known patterns (the digits of each element's index) are written through the
  op into a scratch block and located (:func:`derive_cpu_block_map`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmcache_backend.ops import Ops

logger = logging.getLogger(__name__)

# Digits of an element's index are written as 1..16: integers every fp16/bf16/fp32 holds exactly.
_DIGIT_BITS = 4


def slots_for(block_ids: list[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """``[stop - start]`` int64 slots of token positions ``start..stop-1`` of a request."""
    pos = torch.arange(start, stop, dtype=torch.int64)
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)[pos // block_size]
    return blocks * block_size + pos % block_size


class PagedLayout:
    """Interface: write/read one layer's K/V rows by slot."""

    block_size: int

    def write(
        self, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """``keys``, ``values``: ``[T, Hkv, D]``; ``slots``: ``[T]`` int64."""
        raise NotImplementedError

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, Hkv, D]`` keys and values at ``slots``."""
        raise NotImplementedError


class FlashLayout(PagedLayout):
    """vLLM's flash-attention cache: K and V ``[num_blocks, block_size, Hkv, D]`` each."""

    def __init__(self, block_size: int, ops: Ops) -> None:
        self.block_size = block_size
        self.ops = ops

    @staticmethod
    def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer's cache, ``[2, nb, bs, H, D]`` or ``[nb, 2, bs, H, D]``."""
        if cache.dim() != 5:
            raise ValueError(f"flash-attention cache must be 5-D, got {tuple(cache.shape)}")
        if cache.shape[0] == 2:
            return cache[0], cache[1]
        if cache.shape[1] == 2:
            return cache[:, 0], cache[:, 1]
        raise ValueError(f"no K/V axis of size 2 in cache shape {tuple(cache.shape)}")

    def write(self, cache, keys, values, slots) -> None:
        k_cache, v_cache = self.split(cache)
        self.ops.paged_kv_write(keys, values, k_cache, v_cache, slots.to(cache.device))

    def read(self, cache, slots):
        k_cache, v_cache = self.split(cache)
        return self.ops.paged_kv_read(k_cache, v_cache, slots.to(cache.device))


def _cpu_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
            k_cache, v_cache = _cpu_views(cache)
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
        k_cache, v_cache = _cpu_views(cache)
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
        k_cache, v_cache = _cpu_views(cache)
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
