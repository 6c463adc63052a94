"""Whether blending a prompt pays: its predicted cost against the engine's own prefill, decided
before the connector claims anything.

The cost is counted in token-layers (one token through one decoder layer), the unit every
phase of a blend and of a prefill is made of; measured on the CPU build, a token-layer the blend
computes costs 0.9-1.1x one of vLLM's prefill (``lmcache-backend bench --profile`` prints it as
"marginal cost of a recomputed token-layer"). A claim of the tokens ``prefix..end`` of a prompt
of ``T`` tokens, of which ``R`` come from the store, costs:

* the preview (``query_preview*`` selections): the tokens the question tail holds, in every layer;
* every claimed token the store does not hold (``F = end - prefix - R``, chunk edges and new
  documents), in every layer;
* the recomputed share of the reused tokens (``ratio * R``) in every layer after the selection
  (the check-layer selections also compute every claimed token up to their first check layer);
* the tail ``T - end``, computed by the engine as it would be anyway.

A full prefill computes the ``T - prefix`` tokens vLLM's prefix cache does not hold, in every
layer. The claim is made when the blend's share stays within ``blend_max_cost``; a claim that
would not pay is left to vLLM and recorded with its reason, so that small accidental matches
(boilerplate sentences two prompts share) never make a request slower. A request that sets its
own blend settings in ``kv_transfer_params`` (e.g. ratio 1.0 to check exactness) asked for that
blend: the vLLM connector claims it whenever it reuses ``blend_min_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_backend.blend.selectors.selection import PREVIEW_SELECTIONS
from lmcache_backend.config import BlendConfig


@dataclass(frozen=True)
class BlendEstimate:
    """The predicted cost of blending one prompt.

    Attributes:
        num_tokens: ``T``, the prompt's tokens.
        prefix: tokens vLLM's prefix cache holds (neither a blend nor a prefill computes them).
        end: the claim ends here; the engine computes tokens ``end..T-1``.
        reused: ``R``, claimed tokens whose K/V come from the store.
        cost_share: the blend's token-layers over a full prefill's (``T - prefix`` tokens).
    """

    num_tokens: int
    prefix: int
    end: int
    reused: int
    cost_share: float

    @property
    def fresh(self) -> int:
        """Claimed tokens the store does not hold: the blend computes them in every layer."""
        return self.end - self.prefix - self.reused

    @property
    def reused_share(self) -> float:
        """``R`` over the prompt's tokens."""
        return self.reused / max(self.num_tokens, 1)


def estimate_blend(
    num_tokens: int, prefix: int, end: int, reused: int, config: BlendConfig, num_layers: int
) -> BlendEstimate:
    """The predicted cost of blending tokens ``prefix..end`` of a ``num_tokens`` prompt, ``reused``
    of them from the store, with ``config``'s selection (see the module docstring)."""
    fresh = max(0, end - prefix - reused)
    tail = num_tokens - end
    ratio = config.final_ratio()
    if config.blend_selection in PREVIEW_SELECTIONS:
        layers = float(num_layers) * (tail + fresh + ratio * reused) + num_layers * tail
    else:
        first = config.blend_check_layers[0] + 1  # every claimed token up to the first check layer
        layers = first * (end - prefix) + (num_layers - first) * (fresh + ratio * reused)
        layers += num_layers * tail
    full = float(num_layers) * max(num_tokens - prefix, 1)
    return BlendEstimate(num_tokens, prefix, end, reused, layers / full)
