"""What replaces LMCache's positional-encoding, attention and legacy executor (no LMCache import).

Each class or function here has the call shape of the LMCache object it stands in for (the
contract tests compare the signatures with every supported release), and runs this package's
ops, so the same code serves CUDA (Triton), Ascend (torch-npu) and CPU:

* :func:`fused_rope_factory` for ``get_fused_rope``: the key re-rotation LMCache's GPU connector
  applies to each retrieved layer, through ``rope_rerotate_k`` (LMCache's is a CUDA kernel).
* :class:`ExactMaskAttention` for ``LMCFlashAttnBackend`` / ``infer_attn_backend_from_vllm``: each
  selected query at position ``p`` sees keys ``0..p`` (flash-attention's ``causal=True`` aligns
  the triangle bottom-right when fewer queries than keys remain).
* :class:`LegacyCacheBlendImpl` for ``lmcache.blend.executor.CacheBlendImpl`` (0.3.3, 0.3.7).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lmcache_backend.blend.executor import CacheBlendImpl
from lmcache_backend.models.base import rope_cos_sin_cache
from lmcache_backend.ops import Ops, get_ops

logger = logging.getLogger(__name__)


class PositionSource(Protocol):
    """Whoever knows the positions of the queries being computed (the blender)."""

    def query_positions(self, num_queries: int, device: torch.device) -> torch.Tensor:
        """``[num_queries]`` int64 positions of the current queries."""


# -- positional encoding ------------------------------------------------------------------------


class KeyRerotation:
    """``fn(old_positions [T], new_positions [T], k [T, Hkv*D]) -> k``, rotated in place.

    Called by LMCache's layerwise GPU connector on each retrieved layer's keys.
    """

    def __init__(self, cos_sin_cache: torch.Tensor, head_size: int, is_neox: bool, ops: Ops):
        self.cos_sin_cache = cos_sin_cache
        self.head_size = head_size
        self.is_neox = is_neox
        self.ops = ops
        self._tables: dict[torch.device, torch.Tensor] = {}

    def _table(self, device: torch.device) -> torch.Tensor:
        # One copy per device, made once: the connector calls this for every layer.
        if device not in self._tables:
            self._tables[device] = self.cos_sin_cache.to(device)
        return self._tables[device]

    def __call__(
        self, old_positions: torch.Tensor, new_positions: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        num_tokens = k.shape[0]
        view = k.view(num_tokens, -1, self.head_size)
        old = old_positions.to(k.device)
        new = new_positions.to(k.device)
        moved = torch.nonzero(old != new, as_tuple=False).flatten()
        if moved.numel():
            rows = self.ops.gather_rows(view, moved)
            self.ops.rope_rerotate_k(
                rows, old[moved], new[moved], self._table(k.device), self.is_neox
            )
            self.ops.scatter_rows(view, moved, rows)
        return view.view(num_tokens, -1)


def fused_rope_factory(ops_name: str | None = None) -> Callable[..., KeyRerotation | None]:
    """A ``get_fused_rope`` with LMCache's parameters that builds a :class:`KeyRerotation`."""

    def get_fused_rope(
        head_size: int,
        rotary_dim: int | None = None,
        max_position: int = 8192,
        base: float = 10000.0,
        is_neox_style: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        partial_rotary_factor: float = 1.0,
    ) -> KeyRerotation | None:
        """None (LMCache then disables blending) for RoPE variants the re-rotation cannot
        reproduce, as LMCache does: partial rotary dims and scaled RoPE."""
        rotary_dim = head_size if rotary_dim is None else rotary_dim
        if rotary_dim != head_size or rope_scaling is not None or partial_rotary_factor != 1.0:
            logger.warning(
                "CacheBlend: RoPE with rotary_dim=%s (head %s), scaling=%s, partial factor %s "
                "cannot be re-rotated; blending is disabled",
                rotary_dim,
                head_size,
                rope_scaling,
                partial_rotary_factor,
            )
            return None
        inv_freq = 1.0 / (
            float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        )
        table = rope_cos_sin_cache(inv_freq, int(max_position))
        return KeyRerotation(table, head_size, is_neox_style, get_ops(ops_name))

    return get_fused_rope


# -- attention ------------------------------------------------------------------------------


class ExactMaskMetadata:
    """Attention metadata of one blended request (LMCache's ``LMCAttnMetadata`` shape).

    Attributes:
        num_tokens: ``T``.
        max_query_len: queries still computed.
        query_start_loc: ``[0, max_query_len]`` int32, as LMCache keeps it.
    """

    def __init__(self, num_tokens: int, device: torch.device):
        self.num_tokens = num_tokens
        self.max_query_len = num_tokens
        self.query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)

    def update_from_top_indices(self, top_indices: torch.Tensor) -> None:
        """After a check layer: ``top_indices [N]`` are the tokens kept."""
        self.max_query_len = int(top_indices.numel())
        self.query_start_loc = torch.tensor(
            [0, self.max_query_len], dtype=torch.int32, device=self.query_start_loc.device
        )


def _scale_of(vllm_attn: Any) -> float:
    """The softmax scale of a vLLM attention layer; refuses what the exact kernel lacks."""
    impl = getattr(vllm_attn, "impl", vllm_attn)
    if getattr(impl, "alibi_slopes", None) is not None:
        raise NotImplementedError("CacheBlend attention: ALiBi is not supported")
    if getattr(impl, "logits_soft_cap", None):
        raise NotImplementedError("CacheBlend attention: logits soft-capping is not supported")
    window = getattr(impl, "sliding_window", None)
    if window not in (None, (-1, -1), -1) and not (isinstance(window, tuple) and window[0] < 0):
        raise NotImplementedError(f"CacheBlend attention: sliding window {window} is not supported")
    scale = getattr(impl, "scale", None)
    if scale is None:
        raise ValueError(f"CacheBlend attention: {type(impl).__name__} has no softmax scale")
    return float(scale)


class ExactMaskAttention:
    """Attention of the selected queries over the blended K/V with the exact causal mask.

    Args:
        vllm_attn: the vLLM ``Attention`` layer (its ``impl.scale`` is the softmax scale).
        ops_name: op backend (default: the configured one).
    """

    def __init__(self, vllm_attn: Any, ops_name: str | None = None):
        self.vllm_attn = vllm_attn
        self.scale = _scale_of(vllm_attn)
        self.ops = get_ops(ops_name)
        self.positions: PositionSource | None = None  # set by the blender that owns the model

    def init_attn_metadata(self, input_ids: torch.Tensor, **kwargs: Any) -> ExactMaskMetadata:
        return ExactMaskMetadata(int(input_ids.shape[0]), input_ids.device)

    def forward_contiguous(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``query [N, Hq, D]``, ``key, value [T, Hkv, D]`` -> ``output [N, Hq, D]`` (written)."""
        if self.positions is None:
            raise RuntimeError(
                "CacheBlend attention is not bound to a blender; it is built by the blender "
                "lmcache_backend installs into LMCache"
            )
        q_positions = self.positions.query_positions(query.shape[0], query.device)
        out = self.ops.attention_at_positions(query, key, value, q_positions, self.scale)
        output.copy_(out.view_as(output))
        return output


def attention_factory(ops_name: str | None = None) -> Callable[..., ExactMaskAttention]:
    """An ``infer_attn_backend_from_vllm(vllm_attn, enable_sparse=False)`` returning
    :class:`ExactMaskAttention` for any vLLM attention implementation."""

    def infer_attn_backend_from_vllm(
        vllm_attn: Any, enable_sparse: bool = False
    ) -> ExactMaskAttention:
        # The sparse FlashInfer path approximates the mask block-wise; the exact mask
        # supersedes it.
        return ExactMaskAttention(vllm_attn, ops_name)

    return infer_attn_backend_from_vllm


def attention_class(ops_name: str | None = None) -> type[ExactMaskAttention]:
    """A class constructed like ``LMCFlashAttnBackend(vllm_attn)`` (LMCache 0.3.3)."""

    class LMCFlashAttnBackend(ExactMaskAttention):
        def __init__(self, vllm_attn: Any):
            super().__init__(vllm_attn, ops_name)

    return LMCFlashAttnBackend


# -- legacy executor --------------------------------------------------------------------------


class LegacyCacheBlendImpl(CacheBlendImpl):
    """``lmcache.blend.executor.CacheBlendImpl(recompute_ratio, all_reduce_function=None)``.

    Set the encoders with ``set_positional_encoder`` / ``set_reverse_positional_encoder`` as with
    LMCache's executor.
    """

    def __init__(self, recompute_ratio: float, all_reduce_function: Callable | None = None):
        if all_reduce_function is not None:
            # LMCache reduces the deviation across tensor-parallel ranks; selecting on one rank's
            # heads only would pick different tokens per rank.
            raise NotImplementedError(
                "CacheBlendImpl: all_reduce_function (tensor parallel selection) is not supported"
            )
        super().__init__(recompute_ratio)
