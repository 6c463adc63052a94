"""Scheduler side: which prompts to claim, and the per-step load/save plan for the workers.

A prompt is claimed when the units the store holds beyond vLLM's own prefix hit (chunks, or
blocks found at any offset: :mod:`lmcache_backend.blend.segments.patterns`), plus that prefix, give
at least ``blend_min_tokens`` reusable tokens and the blend is predicted to pay
(:mod:`lmcache_backend.blend.pays`, ``blend_max_cost``). The claim ends where the pattern says
(after the last separator, or after the last block found) and is loaded synchronously (vLLM runs
a synchronous load before the step's forward pass). What follows it (the question, the assistant
header) is never served from the store: vLLM computes it in its own forward pass, over the
blended K/V, and its last token gives the first output token.
Nothing claimed: vLLM prefills normally, the workers store the prompt's units afterwards, and the
request is recorded (log line, ``stats_file`` line with ``"blended": false``) with its reason
(:data:`~lmcache_backend.integration.vllm.reporting.stats.SKIP_REASONS`).

With ``blend_layers_per_step > 0`` (``"auto"``, the default: claims of at least vLLM's
``max_num_batched_tokens``) a claim whose selection never computes a token of the tail in
a blend layer (the preview selections) is loaded asynchronously instead: vLLM allocates blocks for
the claimed tokens only and parks the request in WAITING_FOR_REMOTE_KVS
(``Scheduler.schedule``); the next plan carries a ``sliced`` load, the workers advance it a fixed
number of layer passes per step and report it in ``finished_recving``; vLLM then schedules the
request with the claim counted as computed (``_update_waiting_for_remote_kv``) and computes the
tail. A request aborted meanwhile is sent to the workers as a cancel.

The lookup is the store's cross-process index (:func:`lmcache_backend.storage.create_lookup`),
one per tensor-parallel rank: a segment counts only when every rank holds its shard.

Tenants: a request's ``cache_salt`` (vLLM's ``Request.cache_salt``) is part of every key it looks
up, loads and stores (it travels to the workers in its ``LoadSpec`` and ``SaveSpec``), so requests
of different salts never share a segment, as vLLM's own prefix cache never shares their blocks.
A request with a LoRA adapter is neither claimed nor stored: the keys do not know the adapter
(with blending on, the connector refuses LoRA at start-up; with it off, segments are still stored
for other engines sharing the store, and an adapter's K/V must not reach them).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache_backend.blend.pays import estimate_blend
from lmcache_backend.blend.selectors.selection import PREVIEW_SELECTIONS
from lmcache_backend.integration.vllm.metadata import CacheBlendMetadata, LoadSpec, SaveSpec
from lmcache_backend.integration.vllm.reporting.metrics import CacheBlendStats, take
from lmcache_backend.integration.vllm.reporting.stats import (
    append_json_line,
    left_to_vllm_line,
)
from lmcache_backend.integration.vllm.scheduler_side.request_state import (
    Claim,
    Prompt,
    RequestState,
    SlicedStart,
)
from lmcache_backend.integration.vllm.settings import (
    ConnectorSettings,
    request_config,
    skips_save,
    staleness_probes,
)
from lmcache_backend.logtext import shorten
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage import create_lookup
from lmcache_backend.storage.segments import segment_keys

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from lmcache_backend.compat.profile import VllmProfile

logger = logging.getLogger(__name__)


@dataclass
class ClaimStats:
    """Counters of this scheduler (also logged per request)."""

    requests: int = 0
    claimed_requests: int = 0
    claimed_tokens: int = 0
    #: requests left to vLLM, by reason
    skipped: dict[str, int] = field(default_factory=dict)


def request_salt(request: Request) -> str | None:
    """``request.cache_salt`` as a key namespace: ``None`` for no salt (or an empty one, which
    vLLM's prefix cache treats as none too)."""
    salt = getattr(request, "cache_salt", None)
    if not salt:
        return None
    return salt if isinstance(salt, str) else str(salt)


class SchedulerSide:
    """The scheduler-side logic, free of vLLM imports at run time (requests are read by attribute;
    vLLM's types are named for type checkers only)."""

    def __init__(
        self, settings: ConnectorSettings, fingerprint: ModelFingerprint, profile: VllmProfile
    ):
        self.settings = settings
        self.fingerprint = fingerprint
        self.profile = profile
        self.lookups = [
            create_lookup(
                settings.config,
                instance_id=settings.rank_instance(rank),
                shard=settings.shard(rank),
            )
            for rank in range(settings.tp_size)
        ]
        #: one record per request vLLM asked about and has not finished (request_state.py)
        self.requests: dict[str, RequestState] = {}
        # what the next plan carries besides the step's own loads and saves: the cancels (and
        # loads) of requests finished since the last plan
        self._next_plan = CacheBlendMetadata()
        self._allocations = itertools.count()
        self.stats = ClaimStats()
        self._metrics = CacheBlendStats()

    # -- claims ---------------------------------------------------------------------------

    def _cached(self, keys: list[str]) -> list[bool]:
        hits = [True] * len(keys)
        for lookup in self.lookups:
            hits = [a and b for a, b in zip(hits, lookup.contains_many(keys))]
        return hits

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the connector provides (0, or up to the end of
        the last reused span); a request left to vLLM is recorded once with its reason."""
        rid = request.request_id
        salt = request_salt(request)
        state = self.requests.setdefault(rid, RequestState(salt))
        state.salt, state.claim = salt, None
        tokens = list(request.prompt_token_ids or [])
        if getattr(request, "lora_request", None) is not None:
            state.stored = False  # the keys do not know the adapter
            self._skip(state, rid, len(tokens), "lora", "segment keys do not know adapters")
            return 0
        params = getattr(request, "kv_transfer_params", None)
        if skips_save(params, rid):
            state.stored = False  # the client asked: nothing of this request enters the store
        state.probes = staleness_probes(params, rid)
        config = request_config(self.settings.config, params, self.settings.num_layers, rid)
        if config is None:
            off = not self.settings.config.enable_blending
            self._skip(state, rid, len(tokens), "blending off" if off else "opted out")
            return 0
        self.stats.requests += 1
        pattern = self.settings.separator
        looked_up: list = []

        def held(segments: list) -> list[bool]:
            looked_up.extend(segments)
            spans = [(s.start, s.end) for s in segments]
            return self._cached(segment_keys(self.fingerprint, tokens, spans, salt))

        hits = pattern.match(tokens, held)
        # vLLM computes the rest, at least the last token (it gives the first output token)
        end = min(pattern.claim_end(tokens, hits), len(tokens) - 1)
        reused = sum(
            min(s.end, end) - max(s.start, num_computed_tokens)
            for s in hits
            if min(s.end, end) > max(s.start, num_computed_tokens)
        )
        reusable = num_computed_tokens + reused
        estimate = estimate_blend(
            len(tokens), num_computed_tokens, end, reused, config, self.settings.num_layers
        )
        own_settings = config if config is not self.settings.config else None
        kind = detail = None
        if reused == 0:
            kind = "no reusable span"
            if hits:
                detail = "vLLM's prefix cache holds every reused span"
        elif reusable < config.blend_min_tokens:
            kind = "below blend_min_tokens"
            detail = f"{reusable} reusable tokens < {config.blend_min_tokens}"
        elif own_settings is None and estimate.cost_share > config.blend_max_cost:
            # a request that sets its own blend settings (e.g. ratio 1.0 to check exactness)
            # asked for that blend: it is claimed whenever it reuses enough
            kind = "would not pay"
            detail = (
                f"predicted {estimate.cost_share:.0%} of a full prefill's token-layers > "
                f"blend_max_cost={config.blend_max_cost:g} ({reused} tokens reused, "
                f"{estimate.fresh} of the claim to compute)"
            )
        if kind is not None:
            self._skip(
                state, rid, len(tokens), kind, detail, reusable, len(hits), estimate.cost_share
            )
            return 0
        claim = end - num_computed_tokens
        state.claim = Claim(
            token_ids=tokens,
            prefix_len=num_computed_tokens,
            end=end,
            reusable=reusable,
            config=own_settings,
            sliced=self.settings.blend_layers_per_step > 0
            and config.blend_selection in PREVIEW_SELECTIONS
            and claim >= self.settings.slice_from_tokens,
        )
        state.left_to_vllm, state.claimed_tokens = None, claim
        self.stats.claimed_requests += 1
        self.stats.claimed_tokens += claim
        logger.info(
            "CacheBlend claims %d tokens of request %s (%d tokens, %d reusable in %d of %d "
            "looked-up units, %d from vLLM's prefix cache; predicted %.0f%% of a full "
            "prefill's token-layers)",
            claim,
            shorten(str(rid)),
            len(tokens),
            reusable,
            len(hits),
            len(looked_up),
            num_computed_tokens,
            100.0 * estimate.cost_share,
        )
        return claim

    def _skip(
        self,
        state: RequestState,
        rid: str,
        num_tokens: int,
        reason: str,
        detail: str | None = None,
        reusable: int = 0,
        hits: int = 0,
        cost_share: float | None = None,
    ) -> None:
        """Record that ``rid`` is left to vLLM, once per request (vLLM may ask again while the
        request waits for blocks). ``reason`` is one of :data:`SKIP_REASONS`."""
        if state.left_to_vllm == reason:
            return
        state.left_to_vllm, state.claimed_tokens = reason, 0
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1
        logger.info(
            "CacheBlend leaves request %s (%d tokens) to vLLM: %s%s",
            shorten(str(rid)),
            num_tokens,
            reason,
            f" ({detail})" if detail else "",
        )
        if self.settings.stats_file:
            line = left_to_vllm_line(rid, num_tokens, reason, detail, reusable, hits, cost_share)
            append_json_line(self.settings.stats_file, line)

    def is_sliced(self, request: Request) -> bool:
        """Whether the claim just made for ``request`` is loaded asynchronously."""
        state = self.requests.get(request.request_id)
        return state is not None and state.claim is not None and state.claim.sliced

    def after_alloc(
        self, request: Request, num_external_tokens: int, block_ids: list[int] | None = None
    ) -> None:
        """vLLM allocated ``request``'s blocks (``block_ids``: the first KV-cache group's, read
        for a sliced claim, whose load is planned now: the request is not scheduled)."""
        state = self.requests.get(request.request_id)
        if state is None or state.claim is None:
            return
        if num_external_tokens == 0:  # vLLM chose not to load (e.g. a longer local hit)
            state.claim = None
        elif state.claim.sliced:
            blocks = list(block_ids or [])
            state.sliced_start = SlicedStart(state.claim, blocks, next(self._allocations))
            state.claim = None

    def loads_finished(self, req_ids: Any) -> None:
        """The workers reported these loads finished (``finished_recving``)."""
        for rid in req_ids or ():
            state = self.requests.get(rid)
            if state is not None:
                state.loading = False

    # -- per-step plan --------------------------------------------------------------------

    def build(self, scheduler_output: SchedulerOutput) -> CacheBlendMetadata:
        meta, self._next_plan = self._next_plan, CacheBlendMetadata()
        starting = [(s.sliced_start.order, r) for r, s in self.requests.items() if s.sliced_start]
        for _, rid in sorted(starting):
            meta.loads.append(self._start_sliced(rid, self.requests[rid]))
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                continue  # never asked about (a path that skipped the connector)
            state.prompt = Prompt(list(new.prompt_token_ids or []), list(new.block_ids[0]))
            self._plan(meta, new.req_id, state, new.num_computed_tokens, scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            resumed = self.profile.resumed(cached, i)
            state = self.requests.get(rid)
            if state is None:
                continue
            if state.prompt is None:
                if state.claim is None or not resumed:
                    continue
                # Preempted after its prompt was complete (following it had ended), resumed, and
                # claimed again: vLLM now counts the claimed tokens as computed, so they must be
                # loaded into the new blocks, or decoding would read whatever those blocks held.
                state.prompt = Prompt(state.claim.token_ids)
                logger.info(
                    "request %s resumed after preemption: blending its prompt again",
                    shorten(str(rid)),
                )
            new_blocks = cached.new_block_ids[i]
            if resumed:
                state.prompt.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.prompt.block_ids.extend(new_blocks[0])
            self._plan(meta, rid, state, cached.num_computed_tokens[i], scheduled)
        return meta

    def _start_sliced(self, rid: str, state: RequestState) -> LoadSpec:
        """The load of ``rid``'s sliced claim, whose blocks vLLM allocated; it is in flight
        from now until the workers report it finished."""
        start = state.sliced_start
        spec = self._load_spec(rid, state.salt, start.claim, start.claim.token_ids, start.block_ids)
        state.sliced_start, state.loading = None, True
        return spec

    def _plan(
        self,
        meta: CacheBlendMetadata,
        rid: str,
        state: RequestState,
        num_computed: int,
        scheduled: dict[str, int],
    ) -> None:
        prompt, claim = state.prompt, state.claim
        if claim is not None and num_computed == claim.end:
            meta.loads.append(
                self._load_spec(rid, state.salt, claim, prompt.token_ids, prompt.block_ids)
            )
        state.claim = None
        if num_computed + scheduled.get(rid, 0) >= len(prompt.token_ids):
            # the prompt's K/V are complete after this step: store its segments (unless it must
            # not be: a LoRA request, whose keys do not know the adapter, or one that asked for
            # lmcache.skip_save), stop following
            if state.stored:
                meta.saves.append(
                    SaveSpec(
                        rid, prompt.token_ids, list(prompt.block_ids), state.salt, state.probes
                    )
                )
            state.prompt = None

    @staticmethod
    def _load_spec(
        rid: str, salt: str | None, claim: Claim, tokens: list[int], block_ids: list[int]
    ) -> LoadSpec:
        return LoadSpec(
            rid,
            tokens,
            list(block_ids),
            claim.prefix_len,
            claim.end,
            claim.config,
            claim.sliced,
            salt,
        )

    def take_metrics(self) -> CacheBlendStats | None:
        """The requests finished since the last call, for vLLM's metrics (None: none)."""
        stats, self._metrics = take(self._metrics)
        return stats

    def shutdown(self) -> None:
        """The engine stops: close the lookups, removing each rank's index folder once its
        worker has ended (vLLM may SIGKILL a worker that outlives the engine)."""
        for lookup in self.lookups:
            lookup.close(wait_s=2.0)

    def finished(self, request: Request) -> None:
        """``request`` finished or was aborted: count its decision, cancel its sliced load, and
        forget it (the one place a request's record is removed)."""
        rid = request.request_id
        state = self.requests.pop(rid, None)
        if state is None:
            return
        self._metrics.inc("vllm:cacheblend_requests")
        if state.left_to_vllm is None:
            self._metrics.inc("vllm:cacheblend_requests_claimed")
            self._metrics.inc("vllm:cacheblend_claimed_tokens", state.claimed_tokens)
        else:
            self._metrics.inc("vllm:cacheblend_requests_left_to_vllm", label=state.left_to_vllm)
        # vLLM frees the blocks of a request aborted while loading only once a worker reports
        # it in finished_recving: a load not yet planned is planned and cancelled in one step
        # (workers start a step's loads before its cancels), one in flight is dropped by the
        # workers before their next slice.
        if state.sliced_start is not None:
            self._next_plan.loads.append(self._start_sliced(rid, state))
        if state.loading:
            self._next_plan.cancels.append(rid)
