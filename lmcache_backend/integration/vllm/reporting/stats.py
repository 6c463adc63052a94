"""One record per request the connector blended: logged, kept, and appended to ``stats_file``.

Requests the connector leaves to vLLM get a line of their own from the scheduler side
(:func:`left_to_vllm_line`: ``"blended": false`` and one of :data:`SKIP_REASONS`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lmcache_backend.blend.request import BlendResult
from lmcache_backend.integration.vllm.metadata import LoadSpec
from lmcache_backend.logtext import shorten

logger = logging.getLogger(__name__)


#: Why a request the connector saw is left to vLLM (the ``reason`` of its stats-file line).
SKIP_REASONS = (
    "blending off",  # enable_blending is false: segments are only stored
    "opted out",  # kv_transfer_params {"blend": false}
    "lora",  # a LoRA request: neither blended nor stored
    "no reusable span",  # the store holds none of the prompt (beyond vLLM's prefix hit)
    "below blend_min_tokens",
    "would not pay",  # the predicted blend cost exceeds blend_max_cost
)


def left_to_vllm_line(
    req_id: str,
    num_tokens: int,
    reason: str,
    detail: str | None,
    reusable: int,
    hits: int,
    cost_share: float | None,
) -> dict[str, Any]:
    """The ``stats_file`` line of a request left to vLLM: ``reason`` (one of
    :data:`SKIP_REASONS`), ``detail``, its reusable tokens and units, and the predicted blend
    cost when one was estimated."""
    line = {
        "req_id": req_id,
        "blended": False,
        "reason": reason,
        "detail": detail,
        "num_tokens": num_tokens,
        "num_reusable": reusable,
        "reused_units": hits,
    }
    if cost_share is not None:
        line["predicted_cost_share"] = round(cost_share, 4)
    return line


@dataclass
class BlendRecord:
    """One blended request, as logged and written to ``stats_file``."""

    req_id: str
    num_tokens: int
    prefix_len: int
    claimed: int
    num_reusable: int
    recomputed_reusable: int
    recompute_fraction: float
    token_layer_fraction: float
    fallback_reason: str | None
    blend_ms: float
    #: digest of the recomputed token indices (tensor-parallel ranks must agree on it)
    selected_digest: str = ""
    #: layers whose attention ran through vLLM's own paged attention op
    vllm_attention_layers: int = 0
    #: the last layer's query-key pairs (the blend's computed tokens and vLLM's tail) as a share
    #: of a full prefill's: attention costs by position, so recomputing late tokens costs more
    #: than ``recompute_fraction`` suggests
    attention_fraction: float = 1.0
    #: milliseconds per phase (``time_phases: true`` only): the blender's phases, ``prefix
    #: read`` and ``vllm step`` (vLLM's own forward pass of the step that follows the blend)
    phases_ms: dict[str, float] | None = None
    #: engine steps the blend ran in (more than 1 for a sliced load); ``blend_ms`` counts the
    #: blend's own time only, ``blend_wall_ms`` from its start to its end
    blend_steps: int = 1
    blend_wall_ms: float = 0.0
    #: the request had a ``cache_salt`` (it reused segments of that salt only); the salt itself
    #: is never written: it may name a tenant
    salted: bool = False
    #: the share of what the question reads of the reusable tokens that the recomputed ones
    #: hold (preview selections; ``blend_min_read_share`` targets it), else None
    read_share: float | None = None
    #: the blend's divergence estimate: the staleness-weighted share of the last prompt token's
    #: attention left on tokens not recomputed (preview selections; ``blend_max_divergence``
    #: bounds it)
    divergence: float | None = None
    #: always True here; the lines of requests left to vLLM carry False and a ``reason``
    blended: bool = True


def attention_fraction(computed: torch.Tensor, end: int, num_tokens: int) -> float:
    """Query-key pairs of the tokens ``computed [N]`` (indices) below ``end`` and of every token
    from ``end`` on, over a full prefill's ``T (T + 1) / 2``: a query at position ``p`` reads
    ``p + 1`` keys."""
    mine = computed[computed < end].to(torch.float64)
    pairs = float((mine + 1).sum()) + (end + 1 + num_tokens) * (num_tokens - end) / 2
    return pairs / (num_tokens * (num_tokens + 1) / 2)


@dataclass
class LoadTiming:
    """How long a load took: its own time, wall time from start to end, and engine steps."""

    busy_s: float
    wall_s: float
    steps: int = 1


class BlendStats:
    """The worker's records: built from each load's result, logged, appended to ``stats_file``.

    A timed synchronous load waits for the end of its step (:meth:`finish_step`), so that
    its record can carry the time of vLLM's own forward pass of the question (``vllm step``).

    Args:
        num_layers: the model's layers.
        stats_file: JSON-lines file receiving each record, or None.
        time_phases: records carry their phase times (``phases_ms``).
    """

    def __init__(self, num_layers: int, stats_file: str | None, time_phases: bool) -> None:
        self.num_layers = num_layers
        self.stats_file = stats_file
        self.time_phases = time_phases
        self.records: list[BlendRecord] = []
        self._pending: list[BlendRecord] = []  # timed, waiting for the step's end
        self._loads_done = 0.0

    def record(
        self,
        spec: LoadSpec,
        result: BlendResult,
        paged_layers: int,
        timing: LoadTiming,
        phases: dict[str, float],
    ) -> BlendRecord:
        """Build ``spec``'s record and report it (or, timed and synchronous, at the end of the
        step)."""
        n, layers = len(spec.token_ids), self.num_layers
        record = BlendRecord(
            req_id=spec.req_id,
            num_tokens=n,
            prefix_len=spec.prefix_len,
            claimed=spec.end - spec.prefix_len,
            num_reusable=result.num_reusable,
            recomputed_reusable=result.recomputed_reusable,
            recompute_fraction=result.recomputed_reusable / max(result.num_reusable, 1),
            # vLLM computes tokens end..n-1 in every layer after the blend
            token_layer_fraction=(result.token_layers + (n - spec.end) * layers) / (n * layers),
            fallback_reason=result.fallback_reason,
            blend_ms=timing.busy_s * 1000.0,
            selected_digest=hashlib.sha256(
                result.recomputed.to(torch.int64).numpy().tobytes()
            ).hexdigest()[:16],
            vllm_attention_layers=paged_layers,
            attention_fraction=attention_fraction(result.recomputed, spec.end, n),
            blend_steps=timing.steps,
            blend_wall_ms=timing.wall_s * 1000.0,
            salted=spec.cache_salt is not None,
            read_share=None if result.read_share is None else round(result.read_share, 4),
            divergence=None if result.divergence is None else round(result.divergence, 5),
        )
        if self.time_phases:
            record.phases_ms = phases
        if self.time_phases and not spec.sliced:
            self._pending.append(record)
            self._loads_done = time.perf_counter()
        else:  # a sliced load's tail comes in a later step: no "vllm step"
            self._report(record)
        return record

    def finish_step(self) -> None:
        """After the step's forward pass: report the timed records with vLLM's step time."""
        if not self._pending:
            return
        step_ms = (time.perf_counter() - self._loads_done) * 1000.0
        for record in self._pending:
            record.phases_ms["vllm step"] = round(step_ms, 3)
            self._report(record)
        self._pending = []

    def _report(self, record: BlendRecord) -> None:
        self.records.append(record)
        logger.info(
            "CacheBlend request %s: %d tokens, %d claimed, %d reusable (%d from the prefix "
            "cache), %d reusable recomputed (%.1f%%), %.0f%% token-layers, %.0f ms%s",
            shorten(str(record.req_id)),
            record.num_tokens,
            record.claimed,
            record.num_reusable,
            record.prefix_len,
            record.recomputed_reusable,
            100.0 * record.recompute_fraction,
            100.0 * record.token_layer_fraction,
            record.blend_ms,
            f"; fell back: {record.fallback_reason}" if record.fallback_reason else "",
        )
        if self.stats_file:
            append_json_line(self.stats_file, asdict(record))


def append_json_line(path: str, entry: dict[str, Any]) -> None:
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")
    except OSError as exc:
        logger.warning("cannot append to stats_file %s: %s", path, exc)
