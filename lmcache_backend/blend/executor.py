"""``CacheBlendImpl``: LMCache's per-layer blend executor (``lmcache.blend.executor``).

The serving engine calls :meth:`CacheBlendImpl.blend` once per layer with the retrieved and fresh
K/V of a batch of requests (flattened, ``[T, hidden_dims]``):

* before the first check layer it returns the fresh tensors unchanged;
* at a check layer it keeps, per request, the ``ratio`` share of valid tokens whose fresh key
  deviates most from the re-rotated cached key, plus uncached tokens and the request's last
  token, and returns the short Q with the long blended K/V;
* after it, the engine passes only the kept tokens' fresh Q/K/V and gets the long blended K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lmcache_backend.blend.interfaces import BlendExecutor, BlendOutput
from lmcache_backend.ops import Ops, get_ops
from lmcache_backend.ops.reference import select_topk_with_invalid, selection_count, token_deviation
from lmcache_backend.settings import ENGINE

PositionalEncoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def indices_to_mask(indices: torch.Tensor, size: int) -> torch.Tensor:
    """``[N]`` indices -> ``[size]`` bool mask."""
    mask = torch.zeros(size, dtype=torch.bool, device=indices.device)
    mask[indices] = True
    return mask


def mask_to_indices(mask: torch.Tensor) -> torch.Tensor:
    """``[size]`` bool mask -> sorted ``[N]`` int64 indices."""
    return torch.nonzero(mask, as_tuple=False).flatten()


class CacheBlendImpl(BlendExecutor):
    """Token selection at the check layers and K/V blending for every later layer.

    Args:
        recompute_ratio: fraction of each request's valid tokens kept at a check layer.
        check_layers: layers that select (LMCache's executor checks at layer 1).
        head_dim: head size, to view ``[T, H * D]`` rows as heads for re-rotation.
        cos_sin_cache, is_neox: the model's RoPE table (vLLM layout) for the fused re-rotation;
            alternatively set encoders with :meth:`set_positional_encoder` and
            :meth:`set_reverse_positional_encoder`.
        ops: op set (default ``get_ops()``).
    """

    def __init__(
        self,
        recompute_ratio: float,
        check_layers: Sequence[int] = (1,),
        head_dim: int | None = None,
        cos_sin_cache: torch.Tensor | None = None,
        is_neox: bool = True,
        ops: Ops | None = None,
    ) -> None:
        # the range of a recompute ratio is the registry's (a ConfigError, a ValueError)
        ENGINE["blend_recompute_ratios"].value([recompute_ratio], "recompute_ratio")
        self.recompute_ratio = recompute_ratio
        self.check_layers = tuple(check_layers)
        self.head_dim = head_dim
        self.cos_sin_cache = cos_sin_cache
        self.is_neox = is_neox
        self.ops = ops or get_ops()
        self.positional_encoder: PositionalEncoder | None = None
        self.reverse_positional_encoder: PositionalEncoder | None = None
        self.selected: torch.Tensor | None = None  # global indices kept by the last check
        self.full_positions: torch.Tensor | None = None  # [T] positions of every token

    def set_positional_encoder(self, positional_encoder: PositionalEncoder) -> None:
        """``fn(positions, q, k) -> (q, k)`` applying RoPE at ``positions``."""
        self.positional_encoder = positional_encoder

    def set_reverse_positional_encoder(self, reverse_positional_encoder: PositionalEncoder) -> None:
        """``fn(positions, q, k) -> (q, k)`` removing RoPE applied at ``positions``."""
        self.reverse_positional_encoder = reverse_positional_encoder

    def _rerotate(
        self, k: torch.Tensor, valid: torch.Tensor, old: torch.Tensor, new: torch.Tensor
    ) -> torch.Tensor:
        """Copy of ``k [T, hidden_dims]`` with valid rows moved from ``old`` to ``new``."""
        k = k.clone()
        rows = mask_to_indices(valid.to(k.device) & (old != new))
        if rows.numel() == 0:
            return k
        sub = self.ops.gather_rows(k, rows)
        if self.cos_sin_cache is not None:
            head_dim = self.head_dim or self.cos_sin_cache.shape[-1]
            view = sub.view(sub.shape[0], -1, head_dim)
            self.ops.rope_rerotate_k(view, old[rows], new[rows], self.cos_sin_cache, self.is_neox)
        elif self.positional_encoder and self.reverse_positional_encoder:
            _, sub = self.reverse_positional_encoder(old[rows], sub.clone(), sub)
            _, sub = self.positional_encoder(new[rows], sub.clone(), sub)
        else:
            raise RuntimeError(
                "CacheBlendImpl needs cos_sin_cache or both positional encoders to re-rotate keys"
            )
        return self.ops.scatter_rows(k, rows, sub)

    def blend(
        self,
        layer_id: int,
        retrieved_k: torch.Tensor,
        retrieved_v: torch.Tensor,
        valid_mask: torch.Tensor,
        original_positions: torch.Tensor,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_dim: int,
    ) -> BlendOutput:
        """See the module docstring. ``positions`` are the positions of the rows of ``fresh_q``;
        ``query_start_loc [B + 1]`` splits the full ``T`` tokens into requests."""
        if token_dim != 0:
            raise ValueError(f"token_dim = {token_dim}: only token-major tensors (0) are supported")
        if layer_id < min(self.check_layers):
            self.selected = None
            self.full_positions = positions
            local = torch.arange(fresh_q.shape[0], device=fresh_q.device)
            return BlendOutput(fresh_q, fresh_k, fresh_v, positions, local, None)
        num_tokens = retrieved_k.shape[0]
        valid = valid_mask.to(torch.bool)
        if fresh_q.shape[0] == num_tokens:  # every token is fresh: remember all positions
            self.full_positions = positions.to(retrieved_k.device)
        if self.full_positions is None or self.full_positions.numel() != num_tokens:
            raise RuntimeError(
                f"layer {layer_id}: positions of all {num_tokens} tokens are unknown; call blend "
                "for every layer from layer 0"
            )
        k = self._rerotate(retrieved_k, valid, original_positions, self.full_positions)
        v = retrieved_v.clone()
        if layer_id in self.check_layers:
            return self._check(
                layer_id, k, v, valid, fresh_q, fresh_k, fresh_v, positions, query_start_loc
            )
        if self.selected is None or self.selected.numel() != fresh_q.shape[0]:
            raise RuntimeError(
                f"layer {layer_id}: fresh tensors hold {fresh_q.shape[0]} tokens, the last check "
                f"kept {0 if self.selected is None else self.selected.numel()}"
            )
        self.ops.scatter_rows(k, self.selected, fresh_k)
        self.ops.scatter_rows(v, self.selected, fresh_v)
        local = torch.arange(fresh_q.shape[0], device=fresh_q.device)
        return BlendOutput(fresh_q, k, v, positions, local, None)

    def _check(
        self,
        layer_id: int,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> BlendOutput:
        """Select per request; ``fresh_*`` hold every token (or the previous check's subset)."""
        prior = self.selected
        if prior is None:
            prior = torch.arange(k.shape[0], device=k.device)
        deviation = token_deviation(fresh_k, self.ops.gather_rows(k, prior))
        prior_valid = valid.to(prior.device)[prior]
        bounds = [int(b) for b in query_start_loc]
        kept, new_bounds = [], [0]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            in_request = mask_to_indices((prior >= lo) & (prior < hi))
            if in_request.numel() == 0:
                new_bounds.append(new_bounds[-1])
                continue
            request_valid = valid[lo:hi]
            count = selection_count(
                self.recompute_ratio, int(prior_valid[in_request].sum()), int(request_valid.sum())
            )
            local = select_topk_with_invalid(deviation[in_request], prior_valid[in_request], count)
            # The request's last token always stays: its logits are the request's output.
            last = mask_to_indices(prior == hi - 1)
            local = torch.unique(torch.cat([in_request[local], last]))
            kept.append(local)
            new_bounds.append(new_bounds[-1] + local.numel())
        keep = torch.cat(kept) if kept else torch.empty(0, dtype=torch.int64, device=k.device)
        self.selected = prior[keep]
        self.ops.scatter_rows(k, self.selected, self.ops.gather_rows(fresh_k, keep))
        self.ops.scatter_rows(v, self.selected, self.ops.gather_rows(fresh_v, keep))
        return BlendOutput(
            q=self.ops.gather_rows(fresh_q, keep),
            k=k,
            v=v,
            positions=self.ops.gather_rows(positions, keep),
            local_indices=keep,
            query_start_loc=torch.tensor(new_bounds, dtype=torch.int32, device=k.device),
        )
