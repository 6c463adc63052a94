"""The attention mass a preview collects: how much the query tokens (and the last token alone)
read each key, weighted by the key's value norm, summed over the scored layers.

Every preview layer is computed (the deeper ones need its output), but only the ``scored``
layers' reads count: a shallow layer's cached K/V differ little from a fresh prefill's
(``blend_preview_scored_from``), and a sliding-window layer shorter than the prompt reads only
its end (``blend_preview_scored_layers``), so what those read says little about which tokens'
recomputation pays (docs/quality.md)."""

from __future__ import annotations

import torch

from lmcache_backend.blend.request import BlendMetadata
from lmcache_backend.blend.selection import attention_with_query_mass, value_norms


class PreviewMass:
    """Per-key scores of one preview, ``[T]`` fp32 each.

    Attributes:
        query: value-weighted attention mass from the query tokens (every row of the preview at
            or after ``query_start``).
        last: the same from the last prompt token alone (``query_preview_last``), or None.
        last_reads: the last prompt token's attention probability on each key, summed over
            heads and scored layers, not value-weighted: what the blend's divergence estimate
            weighs (:mod:`lmcache_backend.blend.staleness`).
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
        rows = torch.nonzero(meta.active >= meta.query_start, as_tuple=False).flatten()
        positions = meta.positions[meta.active]
        if self.hidden is None:  # keys neither cached nor previewed: uncached tokens before
            self.hidden = ~meta.valid_mask.clone()  # the query tail (chunk edges, new text)
            self.hidden[meta.active] = False
        kw = {} if window is None else {"window": window}
        if bool(self.hidden.any()):
            kw["hidden"] = self.hidden
        attn, mass, last = attention_with_query_mass(q, keys, values, positions, scale, rows, **kw)
        if self.scored is not None and not self.scored[layer]:
            return attn
        norms = value_norms(values)
        if "hidden" in kw:
            norms = norms.masked_fill(self.hidden, 0.0)
        self.last_reads.add_(last)
        self.query.addcmul_(mass, norms)
        if self.last is not None:
            self.last.addcmul_(last, norms)
        return attn
