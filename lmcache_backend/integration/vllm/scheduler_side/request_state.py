"""What the scheduler side knows about one request: one :class:`RequestState`, created the first
time vLLM asks about the request (``get_num_new_matched_tokens``) and removed in one place, when
vLLM reports it finished or aborted (``request_finished``).

A request's life on the scheduler side, in the record's fields:

1. vLLM asks how many tokens the connector provides: the request's ``salt`` is kept (its key
   namespace), and the decision: claimed (``claim`` holds the claim until its load is planned,
   ``claimed_tokens`` its size) or left to vLLM (``left_to_vllm`` holds the reason). Asked again
   (the request waited for blocks, or was preempted and comes back), the claim is made anew.
2. A sliced claim (``blend_layers_per_step``): once vLLM allocated its blocks, it moves to
   ``sliced_start`` (with the blocks) until the next plan starts the load; then ``loading`` is
   set until a worker reports it finished.
3. Scheduled, the request's ``prompt`` (its tokens and blocks) is followed until its K/V are
   complete, when the plan tells the workers to store its segments; a request preempted after
   that and claimed again is followed again, so that its claim is loaded into its new blocks.
4. Finished or aborted: the decision is counted in the metrics; a sliced load not yet reported
   finished is cancelled; the record is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache_backend.config import BlendConfig


@dataclass
class Claim:
    """Tokens ``prefix_len..end-1`` of a prompt, provided by the connector.

    Attributes:
        token_ids: the prompt.
        prefix_len: tokens vLLM's prefix cache holds.
        end: the claim ends here; vLLM computes the rest.
        reusable: tokens whose K/V come from the store or vLLM's prefix cache.
        config: the request's own settings, or None: the engine's.
        sliced: loaded asynchronously, a few layer passes per step.
    """

    token_ids: list[int]
    prefix_len: int
    end: int
    reusable: int
    config: BlendConfig | None
    sliced: bool = False


@dataclass
class SlicedStart:
    """A sliced claim whose blocks vLLM allocated: its load starts with the next plan.

    Attributes:
        claim: the claim.
        block_ids: its blocks (tokens ``0..end-1``).
        order: when it got them (the loads start oldest first).
    """

    claim: Claim
    block_ids: list[int]
    order: int


@dataclass
class Prompt:
    """A prompt being prefilled: its tokens and the blocks vLLM gave it so far."""

    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)


@dataclass
class RequestState:
    """Everything the scheduler side keeps about one request (see the module docstring).

    Attributes:
        salt: the request's ``cache_salt`` (its key namespace), None: unsalted.
        stored: its segments may be stored (False for a LoRA request: keys do not know
            adapters; and for one whose ``kv_transfer_params`` ask ``lmcache.skip_save``).
        probes: the request is a staleness probe (``lmcache.staleness_probes``): its save
            measures the stored segments it holds instead of storing; 0: not a probe.
        left_to_vllm: why the latest decision left the request to vLLM; None: it was claimed
            (or nothing was decided yet).
        claimed_tokens: the latest claim's size (0 when left to vLLM).
        claim: the latest claim, until its load is planned (a synchronous claim) or vLLM
            allocates its blocks (a sliced one).
        sliced_start: a sliced claim with its blocks, until the next plan starts its load.
        loading: a sliced load was planned and not yet reported finished by the workers.
        prompt: the prompt while it is being prefilled (until its segments are stored).
    """

    salt: str | None
    stored: bool = True
    probes: int = 0
    left_to_vllm: str | None = None
    claimed_tokens: int = 0
    claim: Claim | None = None
    sliced_start: SlicedStart | None = None
    loading: bool = False
    prompt: Prompt | None = None
