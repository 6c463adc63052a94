"""Row gather and in-place row scatter of KV tensors on Ascend.

The scatter uses ``torch_npu.npu_scatter_nd_update_`` (in place, indices ``[N, 1]`` address whole
rows); the gather is ``index_select``, which torch-npu runs as one kernel.
"""

from __future__ import annotations

import torch

from lmcache_backend.backends.ascend._npu import npu, on_npu_reason
from lmcache_backend.ops import register

# Storage dtypes npu_scatter_nd_update_ accepts on Atlas A2/A3.
SCATTER_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.bool,
)


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x [T, ...]``, ``indices [N]`` (int, any device) -> new ``[N, ...]`` on ``x.device``."""
    return x.index_select(0, indices.to(device=x.device, dtype=torch.int64))


def scatter_rows(dst: torch.Tensor, indices: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """In place ``dst[indices] = src``; ``dst [T, ...]``, ``src [N, ...]``. Returns ``dst``.

    ``src`` is cast to ``dst.dtype``; indices must be in range and distinct.
    """
    if indices.numel() == 0:
        return dst
    rows = indices.to(device=dst.device, dtype=torch.int64).reshape(-1, 1)
    npu().npu_scatter_nd_update_(dst, rows, src.to(device=dst.device, dtype=dst.dtype))
    return dst


def scatter_unsupported_reason(
    dst: torch.Tensor, indices: torch.Tensor, src: torch.Tensor
) -> str | None:
    """Why ``npu_scatter_nd_update_`` cannot serve this call, or ``None``."""
    if dst.dtype not in SCATTER_DTYPES:
        return f"dst dtype {dst.dtype} not supported by npu_scatter_nd_update_"
    if not 1 <= dst.dim() <= 8:
        return f"dst is {dst.dim()}-D; npu_scatter_nd_update_ takes 1-D to 8-D"
    return None


def verify_scatter_rows(dst: torch.Tensor, indices: torch.Tensor, src: torch.Tensor) -> str | None:
    """Verifier for the op registry."""
    return on_npu_reason(dst, src) or scatter_unsupported_reason(dst, indices, src)


def verify_gather_rows(x: torch.Tensor, indices: torch.Tensor) -> str | None:
    """Verifier for the op registry."""
    return on_npu_reason(x)


register("ascend", "gather_rows", gather_rows, verify_gather_rows)
register("ascend", "scatter_rows", scatter_rows, verify_scatter_rows)
