"""Scheduler side: which prompts to claim, and the per-step load/save plan for the workers.

A prompt is claimed when the units the store holds beyond vLLM's own prefix hit (chunks, or
blocks found at any offset: :mod:`lmcache_backend.blend.patterns`), plus that prefix, give at
least ``blend_min_tokens`` reusable tokens and the blend is predicted to pay
(:mod:`lmcache_backend.blend.pays`, ``blend_max_cost``). The claim ends where the pattern says
(after the last separator, or after the last block found) and is loaded synchronously (vLLM runs
a synchronous load before the step's forward pass). What follows it (the question, the assistant
header) is never served from the store: vLLM computes it in its own forward pass, over the
blended K/V, and its last token gives the first output token.
Nothing claimed: vLLM prefills normally, the workers store the prompt's units afterwards, and the
request is recorded (log line, ``stats_file`` line with ``"blended": false``) with its reason
(:data:`~lmcache_backend.integration.vllm.stats.SKIP_REASONS`).

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

import logging
from dataclasses import dataclass, field
from typing import Any

from lmcache_backend.blend.pays import estimate_blend
from lmcache_backend.blend.selection import PREVIEW_SELECTIONS
from lmcache_backend.config import BlendConfig
from lmcache_backend.integration.vllm.metadata import CacheBlendMetadata, LoadSpec, SaveSpec
from lmcache_backend.integration.vllm.metrics import CacheBlendStats, take
from lmcache_backend.integration.vllm.settings import ConnectorSettings, request_config
from lmcache_backend.integration.vllm.stats import (
    append_json_line,
    left_to_vllm_line,
)
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage import create_lookup
from lmcache_backend.storage.segments import segment_keys

logger = logging.getLogger(__name__)


@dataclass
class _Claim:
    token_ids: list[int]
    prefix_len: int
    end: int
    reusable: int
    #: the request's own settings, or None: the engine's
    config: BlendConfig | None
    sliced: bool = False
    cache_salt: str | None = None


@dataclass
class _Tracked:
    """A request whose prompt is still being prefilled."""

    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None


@dataclass
class ClaimStats:
    """Counters of this scheduler (also logged per request)."""

    requests: int = 0
    claimed_requests: int = 0
    claimed_tokens: int = 0
    #: requests left to vLLM, by reason
    skipped: dict[str, int] = field(default_factory=dict)


def request_salt(request: Any) -> str | None:
    """``request.cache_salt`` as a key namespace: ``None`` for no salt (or an empty one, which
    vLLM's prefix cache treats as none too)."""
    salt = getattr(request, "cache_salt", None)
    if not salt:
        return None
    return salt if isinstance(salt, str) else str(salt)


class SchedulerSide:
    """The scheduler-side logic, free of vLLM types (requests are read by attribute)."""

    def __init__(self, settings: ConnectorSettings, fingerprint: ModelFingerprint, profile: Any):
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
        self._claims: dict[str, _Claim] = {}
        self._tracked: dict[str, _Tracked] = {}
        # sliced claims: allocated, their load not yet planned (rid -> claim, block ids)
        self._starting: dict[str, tuple[_Claim, list[int]]] = {}
        # sliced loads planned and not yet reported finished by the workers
        self._loading: set[str] = set()
        self._cancels: list[str] = []
        # request -> its key namespace (cache_salt), read when vLLM asks about the request and
        # used when its prompt is planned for saving; a request missing here is never stored
        self._salts: dict[str, str | None] = {}
        # request -> (why it is left to vLLM, or None: claimed; claimed tokens), the latest
        # decision: a reason is recorded once per request, the decision is counted in the
        # metrics when the request finishes
        self._decisions: dict[str, tuple[str | None, int]] = {}
        self.stats = ClaimStats()
        self._metrics = CacheBlendStats()

    # -- claims ---------------------------------------------------------------------------

    def _cached(self, keys: list[str]) -> list[bool]:
        hits = [True] * len(keys)
        for lookup in self.lookups:
            hits = [a and b for a, b in zip(hits, lookup.contains_many(keys))]
        return hits

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the connector provides (0, or up to the end of
        the last reused span); a request left to vLLM is recorded once with its reason."""
        rid = request.request_id
        self._claims.pop(rid, None)
        salt = request_salt(request)
        tokens = list(request.prompt_token_ids or [])
        if getattr(request, "lora_request", None) is not None:
            self._salts.pop(rid, None)  # never stored: the keys do not know the adapter
            self._skip(rid, len(tokens), "lora", "segment keys do not know adapters")
            return 0
        self._salts[rid] = salt
        config = request_config(
            self.settings.config,
            getattr(request, "kv_transfer_params", None),
            self.settings.num_layers,
            rid,
        )
        if config is None:
            off = not self.settings.config.enable_blending
            self._skip(rid, len(tokens), "blending off" if off else "opted out")
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
            self._skip(rid, len(tokens), kind, detail, reusable, len(hits), estimate.cost_share)
            return 0
        claim = end - num_computed_tokens
        self._claims[rid] = _Claim(
            token_ids=tokens,
            prefix_len=num_computed_tokens,
            end=end,
            reusable=reusable,
            config=own_settings,
            sliced=self.settings.blend_layers_per_step > 0
            and config.blend_selection in PREVIEW_SELECTIONS
            and claim >= self.settings.slice_from_tokens,
            cache_salt=salt,
        )
        self._decisions[rid] = (None, claim)
        self.stats.claimed_requests += 1
        self.stats.claimed_tokens += claim
        logger.info(
            "CacheBlend claims %d tokens of request %s (%d tokens, %d reusable in %d of %d "
            "looked-up units, %d from vLLM's prefix cache; predicted %.0f%% of a full "
            "prefill's token-layers)",
            claim,
            rid,
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
        if self._decisions.get(rid, (None, 0))[0] == reason:
            return
        self._decisions[rid] = (reason, 0)
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1
        logger.info(
            "CacheBlend leaves request %s (%d tokens) to vLLM: %s%s",
            rid,
            num_tokens,
            reason,
            f" ({detail})" if detail else "",
        )
        if self.settings.stats_file:
            line = left_to_vllm_line(rid, num_tokens, reason, detail, reusable, hits, cost_share)
            append_json_line(self.settings.stats_file, line)

    def is_sliced(self, request: Any) -> bool:
        """Whether the claim just made for ``request`` is loaded asynchronously."""
        claim = self._claims.get(request.request_id)
        return claim is not None and claim.sliced

    def after_alloc(self, request: Any, num_external_tokens: int, block_ids: Any = None) -> None:
        """vLLM allocated ``request``'s blocks (``block_ids``: the first KV-cache group's, read
        for a sliced claim, whose load is planned now: the request is not scheduled)."""
        rid = request.request_id
        if num_external_tokens == 0:  # vLLM chose not to load (e.g. a longer local hit)
            self._claims.pop(rid, None)
            return
        claim = self._claims.get(rid)
        if claim is not None and claim.sliced:
            self._starting[rid] = (self._claims.pop(rid), list(block_ids or []))

    def loads_finished(self, req_ids: Any) -> None:
        """The workers reported these loads finished (``finished_recving``)."""
        for rid in req_ids or ():
            self._loading.discard(rid)

    # -- per-step plan --------------------------------------------------------------------

    def build(self, scheduler_output: Any) -> CacheBlendMetadata:
        meta = CacheBlendMetadata(cancels=self._cancels)
        self._cancels = []
        for rid, (claim, block_ids) in self._starting.items():
            meta.loads.append(self._load_spec(rid, claim, claim.token_ids, block_ids, sliced=True))
            self._loading.add(rid)
        self._starting = {}
        self._loading.difference_update(meta.cancels)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._salts:
                # never asked about (a LoRA request, or a path that skipped the connector):
                # its namespace is unknown, so nothing of it is stored
                continue
            tokens = list(new.prompt_token_ids or [])
            tracked = _Tracked(tokens, list(new.block_ids[0]), self._salts[new.req_id])
            self._tracked[new.req_id] = tracked
            self._plan(meta, new.req_id, tracked, new.num_computed_tokens, scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            resumed = self.profile.resumed(cached, i)
            tracked = self._tracked.get(rid)
            if tracked is None:
                claim = self._claims.get(rid)
                if claim is None or not resumed:
                    continue
                # Preempted after its prompt was complete (tracking had ended), resumed, and
                # claimed again: vLLM now counts the claimed tokens as computed, so they must be
                # loaded into the new blocks, or decoding would read whatever those blocks held.
                tracked = _Tracked(claim.token_ids, cache_salt=claim.cache_salt)
                self._tracked[rid] = tracked
                logger.info("request %s resumed after preemption: blending its prompt again", rid)
            new_blocks = cached.new_block_ids[i]
            if resumed:
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            self._plan(meta, rid, tracked, cached.num_computed_tokens[i], scheduled)
        return meta

    def _plan(
        self,
        meta: CacheBlendMetadata,
        rid: str,
        tracked: _Tracked,
        num_computed: int,
        scheduled: dict[str, int],
    ) -> None:
        claim = self._claims.pop(rid, None)
        if claim is not None and num_computed == claim.end:
            meta.loads.append(self._load_spec(rid, claim, tracked.token_ids, tracked.block_ids))
        if num_computed + scheduled.get(rid, 0) >= len(tracked.token_ids):
            # the prompt's K/V are complete after this step: store its segments, stop tracking
            meta.saves.append(
                SaveSpec(rid, tracked.token_ids, list(tracked.block_ids), tracked.cache_salt)
            )
            self._tracked.pop(rid, None)

    @staticmethod
    def _load_spec(
        rid: str, claim: _Claim, tokens: list[int], block_ids: list[int], sliced: bool = False
    ) -> LoadSpec:
        return LoadSpec(
            rid,
            tokens,
            list(block_ids),
            claim.prefix_len,
            claim.end,
            claim.config,
            sliced,
            claim.cache_salt,
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

    def finished(self, request: Any) -> None:
        rid = request.request_id
        self._claims.pop(rid, None)
        self._tracked.pop(rid, None)
        self._salts.pop(rid, None)
        decision = self._decisions.pop(rid, None)
        if decision is not None:
            reason, claimed = decision
            self._metrics.inc("vllm:cacheblend_requests")
            if reason is None:
                self._metrics.inc("vllm:cacheblend_requests_claimed")
                self._metrics.inc("vllm:cacheblend_claimed_tokens", claimed)
            else:
                self._metrics.inc("vllm:cacheblend_requests_left_to_vllm", label=reason)
        # vLLM frees the blocks of a request aborted while loading only once a worker reports
        # it in finished_recving: a load not yet planned is planned and cancelled in one step
        # (workers start a step's loads before its cancels), one in flight is dropped by the
        # workers before their next slice.
        if rid in self._starting or rid in self._loading:
            self._loading.discard(rid)
            self._cancels.append(rid)
