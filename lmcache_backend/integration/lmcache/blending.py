"""The per-layer CacheBlend step inside LMCache's layerwise model loop (no LMCache import).

LMCache's loop hands the blender, per layer, the fresh ``q, k, v`` of the tokens still computed
and exposes the cached K/V of that layer in its GPU buffer (already moved to the new positions
by the positional-encoding hook; rows of uncached tokens are zero). This module decides which
tokens stay and writes their fresh rows into that buffer, which LMCache later copies into the
engine's paged cache. Selection follows :class:`lmcache_backend.blend.LMCBlender`:

* every check layer keeps ``ratio * num_reusable`` valid tokens of the prompt by key deviation,
  chosen among those still active, plus every uncached token and the last token;
* the ratio is a fraction of all reusable tokens, so several check layers filter gradually;
* with fewer reusable tokens than ``blend_min_tokens`` nothing is selected: a full prefill.

Tensors are LMCache's flat layout: ``[N, H * D]`` rows, one per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_backend.config import BlendConfig
from lmcache_backend.ops import Ops


@dataclass
class RequestState:
    """One blended request.

    Attributes:
        positions: ``[T]`` int64 positions of the request's tokens.
        active: ``[N]`` int64 sorted indices of the tokens still computed.
        valid_mask: ``[T]`` bool, True where the buffer row came from the cache.
        num_reusable: valid tokens at the start (every ratio applies to it).
        schedule: check layer -> ratio (empty: full prefill).
        token_layers: sum over layers of the number of tokens computed.
    """

    positions: torch.Tensor
    active: torch.Tensor
    valid_mask: torch.Tensor
    num_reusable: int
    schedule: dict[int, float]
    token_layers: int = 0

    @property
    def active_positions(self) -> torch.Tensor:
        """``[N]`` positions of the tokens computed at the current layer."""
        return self.positions[self.active]


def begin_request(
    num_tokens: int, gap_positions: torch.Tensor | None, config: BlendConfig, device: torch.device
) -> RequestState:
    """State for a request of ``num_tokens`` whose rows ``gap_positions`` were not retrieved.

    Args:
        num_tokens: ``T``.
        gap_positions: ``[G]`` int64 indices of rows without cached K/V (None: all cached).
        config: check layers, ratios and ``blend_min_tokens``.
        device: where the index tensors live (the buffer's device).
    """
    valid = torch.ones(num_tokens, dtype=torch.bool, device=device)
    if gap_positions is not None and gap_positions.numel():
        valid[gap_positions.to(device=device, dtype=torch.int64)] = False
    num_reusable = int(valid.sum())
    schedule = dict(config.check_schedule()) if num_reusable >= config.blend_min_tokens else {}
    if not schedule:
        valid.zero_()
        num_reusable = 0
    return RequestState(
        positions=torch.arange(num_tokens, device=device, dtype=torch.int64),
        active=torch.arange(num_tokens, device=device, dtype=torch.int64),
        valid_mask=valid,
        num_reusable=num_reusable,
        schedule=schedule,
    )


def blend_step(
    ops: Ops,
    state: RequestState,
    layer_id: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    residual: torch.Tensor,
    attn_output: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None
]:
    """Blend one layer.

    Args:
        ops: the op set.
        state: the request (``active`` is updated at a check layer).
        layer_id: the layer.
        q: ``[N, Hq*D]``; k, v: ``[N, Hkv*D]`` fresh rows of the active tokens, RoPE applied.
        residual: ``[N, hidden]``; attn_output: ``[N, Hq*D]`` output buffer.
        cached_k, cached_v: ``[T, Hkv*D]`` the layer's buffer; the active tokens' fresh rows are
            written into it in place (it becomes the blended K/V).

    Returns:
        ``(q, cached_k, cached_v, residual, attn_output, kept)``: q/residual/attn_output reduced
        to the tokens still active; ``kept`` holds their ``[N']`` global indices when this layer
        selected, else None.
    """
    num_tokens = state.positions.numel()
    if cached_k.shape[0] != num_tokens:
        raise RuntimeError(
            f"layer {layer_id}: LMCache's buffer holds {cached_k.shape[0]} rows for a request of "
            f"{num_tokens} tokens; CacheBlend needs the retrieval to start at the first token "
            "(disable vLLM's prefix caching with blending)"
        )
    kept = None
    if layer_id in state.schedule:
        active = state.active
        keep = ops.kv_deviation_topk(
            k,
            ops.gather_rows(cached_k, active),
            state.valid_mask[active],
            state.schedule[layer_id],
            state.num_reusable,
        )
        last = active.numel() - 1
        if keep.numel() == 0 or int(keep[-1]) != last:  # the last token's logits are needed
            keep = torch.cat([keep, torch.tensor([last], device=keep.device, dtype=keep.dtype)])
        state.active = active[keep.to(active.device)]
        q, k, v, residual, attn_output = (
            ops.gather_rows(t, keep) for t in (q, k, v, residual, attn_output)
        )
        kept = state.active
    # Before the first check every row is fresh: writing them all keeps uncached (zero) rows
    # and stale cached rows out of the paged cache.
    ops.scatter_rows(cached_k, state.active, k)
    ops.scatter_rows(cached_v, state.active, v)
    state.token_layers += int(state.active.numel())
    return q, cached_k, cached_v, residual, attn_output, kept
