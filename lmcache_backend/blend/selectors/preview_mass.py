"""The attention mass a preview collects: how much the query tokens (and the last token alone)
read each key, weighted by the key's value norm, summed over the scored layers.

Every preview layer is computed (the deeper ones need its output), but only the ``scored``
layers' reads count: a shallow layer's cached K/V differ little from a fresh prefill's
(``blend_preview_scored_from``), and a sliding-window layer shorter than the prompt reads only
its end (``blend_preview_scored_layers``), so what those read says little about which tokens'
recomputation pays (docs/quality.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_backend.blend.request import BlendMetadata
from lmcache_backend.blend.selectors.selection import (
    QueryMasks,
    attention_with_query_mass,
    query_masks,
    value_norms,
)
from lmcache_backend.ops.memo import TensorMemo


@dataclass(frozen=True)
class _PassRows:
    """What every layer of a preview pass reads of its rows, found once per pass (the only
    place the pass waits for the device: the number of query rows)."""

    positions: torch.Tensor  # [N] of the active rows
    query_rows: torch.Tensor  # [M] rows of the active ones at or after query_start
    masks: QueryMasks  # the causal mask, the layer's window and the hidden keys


class PreviewMass:
    """Per-key scores of one preview, ``[T]`` fp32 each.

    Attributes:
        query: value-weighted attention mass from the query tokens (every row of the preview at
            or after ``query_start``).
        last: the same from the last prompt token alone (``query_preview_last``), or None.
        last_reads: the last prompt token's attention probability on each key, summed over
            heads and scored layers, not value-weighted: what the blend's divergence estimate
            weighs (:mod:`lmcache_backend.blend.selectors.staleness`).
    """

    def __init__(
        self,
        num_tokens: int,
        device: torch.device,
        with_last: bool,
        scored: list[bool] | None = None,
    ) -> None:
        #: per layer, whether its reads count (None: every layer's)
        self.scored = scored
        self.query = torch.zeros(num_tokens, dtype=torch.float32, device=device)
        self.last = torch.zeros_like(self.query) if with_last else None
        self.last_reads = torch.zeros_like(self.query)
        self.hidden: torch.Tensor | None = None
        self._rows: TensorMemo[_PassRows] = TensorMemo(size=4)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        meta: BlendMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Preview layer ``layer``'s attention ``[N, Hq, D]`` of the active tokens' ``q [N, Hq, D]``
        over the layer's blended ``keys``/``values`` ``[T, Hkv, D]``; adds the mass the query
        tokens (and the last token alone) give each key, weighted by its value norm. ``window``:
        the layer's sliding window, if it has one. A layer that is not ``scored`` adds
        nothing."""
        rows = self._rows.get(
            (meta.active, keys.shape[0], window), lambda: self._pass_rows(meta, keys, window)
        )
        attn, mass, last = attention_with_query_mass(
            q, keys, values, rows.positions, scale, rows.query_rows, window=window, masks=rows.masks
        )
        if self.scored is not None and not self.scored[layer]:
            return attn
        norms = value_norms(values)  # the hidden keys' mass is 0: so is what they add
        self.last_reads.add_(last)
        self.query.addcmul_(mass, norms)
        if self.last is not None:
            self.last.addcmul_(last, norms)
        return attn

    def _pass_rows(self, meta: BlendMetadata, keys: torch.Tensor, window: int | None) -> _PassRows:
        if self.hidden is None:  # keys neither cached nor previewed: uncached tokens before
            self.hidden = ~meta.valid_mask.clone()  # the query tail (chunk edges, new text)
            self.hidden[meta.active] = False
        rows = torch.nonzero(meta.active >= meta.query_start, as_tuple=False).flatten()
        positions = meta.positions[meta.active]
        # the hidden keys' K/V rows are finite (the blend's cached K/V are zero where no hit
        # covers them, the pass scatters only its own rows): one additive mask hides them
        masks = query_masks(positions.to(keys.device), keys.shape[0], rows, window, self.hidden)
        return _PassRows(positions, rows, masks)
