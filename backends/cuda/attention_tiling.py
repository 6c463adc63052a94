"""How a launch of the attention kernels is tiled: the tile sizes, the tiling choices measured
on an H100 (``docs/measurements/h100-kernels.md``), and the grid and TMA descriptors that follow
from them. Shared by :mod:`.attention` and :mod:`.paged_attention`; no Triton kernel here."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AttentionTiling:
    """How one launch of the attention kernels is tiled.

    Attributes:
        block_m, block_n: query rows and keys per tile.
        num_warps, num_stages: Triton's launch options.
        split: walk the key tiles every row sees without the causal mask, then the rest masked.
        heavy_first: start the query tiles with the most keys first (see ``_query_rows``).
        tma: load K/V tiles with the tensor memory accelerator (contiguous kernel, Hopper and
            later; taken only where the tensors allow it, see :func:`tma_descriptors`).
        prefetch: read the next tile's block numbers one tile ahead (paged kernel).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split: bool = False
    heavy_first: bool = False
    tma: bool = False
    prefetch: bool = False


#: keys above which the 16-bit contiguous kernel takes 128-row tiles (see :func:`default_tiling`)
_LONG_PROMPT_KEYS = 16384


def default_tiling(head_dim: int, head_dim_v: int, fp32: bool, num_k: int = 0) -> AttentionTiling:
    """The contiguous kernel's tiling for these head dims, dtype and key count.

    16-bit head dims up to 128, measured on an H100 (``docs/measurements/h100-kernels.md``,
    32/8 heads of 128, 15% of the positions as queries): 64 x 64 tiles, 4 warps, 3 stages up to
    16k keys (0.174 ms at 8k, 3.6x masked SDPA), 128 x 64 tiles with 8 warps above (2.82 ms at
    32k, 3.0x), each with the mask-free walk, the longest tiles first and TMA loads (Hopper
    and later; pointer loads elsewhere). fp32 or 256-wide heads take 32 x 32 tiles and two
    pipeline stages to fit one program's registers and shared memory; fp32 with 256-wide heads
    one stage (two already need 100 KB of shared memory, over the 99 KB of sm_86/sm_89).
    """
    widest = max(head_dim, head_dim_v)
    if fp32 and widest >= 256:
        return AttentionTiling(32, 32, 4, 1, split=True, heavy_first=True)
    if fp32 or widest >= 256:
        return AttentionTiling(32, 32, 4, 2, split=True, heavy_first=True)
    if num_k > _LONG_PROMPT_KEYS:
        return AttentionTiling(128, 64, 8, 3, split=True, heavy_first=True, tma=True)
    return AttentionTiling(64, 64, 4, 3, split=True, heavy_first=True, tma=True)


def default_paged_tiling(head_dim: int, head_dim_v: int, fp32: bool) -> AttentionTiling:
    """The paged kernel's tiling: for 16-bit head dims up to 128, 128 x 64 tiles with 8 warps,
    the mask-free walk, the longest tiles first and the block numbers read a tile ahead (the
    fastest on an H100 at 8k and 32k keys: 0.264 and 3.42 ms); else the contiguous kernel's
    tiles (it has no TMA: its keys are found through the block table)."""
    if fp32 or max(head_dim, head_dim_v) >= 256:
        return replace(default_tiling(head_dim, head_dim_v, fp32), tma=False)
    return AttentionTiling(128, 64, 8, 3, split=True, heavy_first=True, prefetch=True)


#: CUDA's limit on a grid's second dimension (the first allows 2**31 - 1)
_MAX_GRID_Y = 65535


def fit_grid(
    tiling: AttentionTiling, rows: int, num_kv_heads: int
) -> tuple[AttentionTiling, tuple[int, int]]:
    """The grid of query tiles and KV heads, in ``tiling``'s order; ``heavy_first`` is dropped
    where the tiles would overflow the grid's second dimension."""
    tiles = -(-rows // tiling.block_m)
    if tiling.heavy_first and tiles > _MAX_GRID_Y:
        tiling = replace(tiling, heavy_first=False)
    return tiling, ((num_kv_heads, tiles) if tiling.heavy_first else (tiles, num_kv_heads))


def tma_descriptors(k: torch.Tensor, v: torch.Tensor, tiling: AttentionTiling):
    """``(k_desc, v_desc)`` over ``[Nk, Hkv * D]`` views of K and V, or ``(None, None)`` where
    the tensor memory accelerator cannot take them: a GPU before Hopper, rows that are not
    ``[Hkv, D]`` dense, or strides and bases off 16-byte alignment."""
    if not tiling.tma or (
        k.device.type == "cuda" and torch.cuda.get_device_capability(k.device)[0] < 9
    ):
        return None, None
    descriptors = []
    for t in (k, v):
        n, h, d = t.shape
        if t.stride(1) != d or t.stride(2) != 1:
            return None, None
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return None, None
        from triton.tools.tensor_descriptor import TensorDescriptor

        flat = t.as_strided((n, h * d), (t.stride(0), 1))
        descriptors.append(
            TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [tiling.block_n, d])
        )
    return tuple(descriptors)
