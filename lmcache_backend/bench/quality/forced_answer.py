"""Teacher-forced answers in vLLM: a logits processor that makes a greedy request emit given
tokens, so its per-step log-probabilities are the model's distributions along another answer.

The benchmark scores a strategy by ``KL(full || strategy)`` at every token of full prefill's
answer, each given the tokens of *that* answer before it (no cascade: one early difference does
not move every later position). vLLM reports a request's log-probabilities from the raw logits,
before logits processors (``logprobs_mode="raw_logprobs"``, its default), so a request with
``extra_args={"forced_tokens": [...]}`` and ``logprobs=-1`` gives exactly those distributions
while this processor puts each step's forced token on top.

Importing this module imports vLLM; the engine loads it by name (:data:`FQCN`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

#: the ``SamplingParams.extra_args`` key holding the tokens to emit
FORCED_TOKENS = "forced_tokens"
#: how ``vllm.LLM(logits_processors=[...])`` names this processor
FQCN = f"{__name__}:ForcedAnswer"


class ForcedAnswer(AdapterLogitsProcessor):
    """Step ``j`` of a request with ``extra_args["forced_tokens"]`` keeps only token ``j`` of
    that list (then the model's own logits, once the list is used up)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(
        self, params: SamplingParams
    ) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        forced = (params.extra_args or {}).get(FORCED_TOKENS)
        if not forced:
            return None
        tokens = [int(t) for t in forced]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step >= len(tokens):
                return logits
            only = torch.full_like(logits, float("-inf"))
            only[tokens[step]] = 0.0
            return only

        return force
