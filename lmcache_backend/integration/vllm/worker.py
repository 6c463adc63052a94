"""Worker side: blend claimed prompts into vLLM's paged cache, store the segments of prompts.

Before a step's forward pass (``start_load_kv``), each claimed request is blended with the
model's own weights (through :class:`~lmcache_backend.models.vllm.VLLMModelAdapter`). Tokens
vLLM's prefix cache already holds are read back from the paged cache and passed as
``cached_prefix``. Each layer's blended K/V rows of the claimed tokens go into the paged cache as
soon as the layer is final. On vLLM's CPU backend the blender's attention runs there, through
vLLM's paged-attention op; and once a preview selection is fixed, a synchronous load writes every
cached row and runs the selected tokens through vLLM's own compiled forward pass, in a forward
context of its own (its attention metadata and slot mapping name only those tokens' rows; see
:mod:`~lmcache_backend.integration.vllm.engine_forward`, connector key ``engine_forward``).

With ``blend_layers_per_step > 0``, a sliced load (:attr:`LoadSpec.sliced`) starts a blend that
advances that many layer passes per step (preview layers count), the oldest blend first; once
it completes, the request is reported in ``finished_recving`` (``get_finished``) and vLLM
schedules its tail. Its rows stop at the claim's end (vLLM allocated no blocks for the tail) and
the blender runs with ``strict_end``: no blend layer computes a tail token.

After the forward pass (``wait_for_save``), prompts whose K/V are complete are read back from the
paged cache and their segments stored (those the store lacks), whichever path computed them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lmcache_backend.blend import LMCBlender, SegmentCache
from lmcache_backend.blend.blender import run_to_end
from lmcache_backend.blend.timing import NO_TIMER, PhaseTimer
from lmcache_backend.config import BlendConfig, ConfigError
from lmcache_backend.integration.vllm.engine_forward import Attend, EngineForward
from lmcache_backend.integration.vllm.layouts import (
    AttentionPlan,
    CpuAttention,
    CpuLayout,
    FlashLayout,
    PagedLayout,
    slots_for,
)
from lmcache_backend.integration.vllm.metadata import LoadSpec, SaveSpec
from lmcache_backend.integration.vllm.model_tracker import ENGINE_NAME, ModelTracker
from lmcache_backend.integration.vllm.settings import ConnectorSettings
from lmcache_backend.models.vllm import VLLMModelAdapter
from lmcache_backend.ops import Ops, get_ops
from lmcache_backend.ops.cpu_kernels import KernelUnavailable, TiledAttention, load_tiled_attention
from lmcache_backend.ops.reference import kv_deviation_topk
from lmcache_backend.storage import create_store

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
    #: milliseconds per phase (``profile: true`` only): the blender's phases, ``prefix read``
    #: and ``vllm step`` (vLLM's own forward pass of the step that follows the blend)
    profile: dict[str, float] | None = None
    #: engine steps the blend ran in (more than 1 for a sliced load); ``blend_ms`` counts the
    #: blend's own time only, ``blend_wall_ms`` from its start to its end
    blend_steps: int = 1
    blend_wall_ms: float = 0.0


class _PagedWriter:
    """The blender's per-layer sink: writes the claimed rows of each finished layer.

    With ``attention`` (vLLM's CPU paged-attention op) it also serves the blender's attention:
    every row of a layer is written into the paged cache first, then the selected queries attend
    over it there (:class:`~lmcache_backend.blend.blender.PagedKV`).
    """

    def __init__(
        self,
        layout: PagedLayout,
        caches: list[torch.Tensor],
        attention: CpuAttention | None,
        engine_forward: EngineForward | None = None,
        blend_in_layers: bool = False,
        tiled_attention: TiledAttention | None = None,
    ) -> None:
        self.layout, self.caches, self._attention = layout, caches, attention
        self._engine_forward = engine_forward
        self._tiled_attention = tiled_attention
        # a sliced load's blend layers stay layer passes (a step runs a few of them); its
        # preview, one pass anyway, still goes through the engine
        self._blend_in_layers = blend_in_layers
        self.slots = torch.empty(0, dtype=torch.int64)
        self.start = self.stop = 0
        self.block_ids: torch.Tensor | None = None
        self._plan: AttentionPlan | None = None
        self.paged_layers = 0

    def target(
        self, slots: torch.Tensor, start: int, stop: int, block_ids: torch.Tensor | None = None
    ) -> None:
        """Write tokens ``start..stop-1`` to ``slots`` (``[stop - start]``); with ``block_ids``
        (the request's whole block table, ``stop`` its last token + 1) attend over them too."""
        self.slots, self.start, self.stop = slots, start, stop
        self.block_ids = block_ids if self._attention is not None else None
        self._plan = None
        self.paged_layers = 0  # layers of the current request attended over the paged cache
        self.engine_previewed = False  # the request's preview ran through vLLM's forward pass

    @property
    def attention_op(self) -> CpuAttention | None:
        return self._attention

    @property
    def paged_attention(self) -> bool:
        return self.block_ids is not None

    @property
    def engine_forward(self) -> EngineForward | None:
        return self._engine_forward

    @property
    def tiled_attention(self) -> TiledAttention | None:
        return self._tiled_attention

    @property
    def runs_engine_forward(self) -> bool:
        """Whether :meth:`forward_rows` can run (paged attention over the request's blocks, the
        blend not in layer passes)."""
        return (
            self._engine_forward is not None and not self._blend_in_layers and self.paged_attention
        )

    def forward_rows(
        self,
        rows: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Tokens ``rows [N]`` (``token_ids [N]`` at sorted ``positions [N]``) through vLLM's
        forward pass, writing their rows of every layer. Rows in vLLM's prefix cache are left
        out: their K/V there are already a full prefill's (see :meth:`_own_rows`). ``kv``: the
        request's blended K/V (``[L, T, Hkv, D]`` each) for the tiled kernel, if it runs."""
        slots, token_ids, positions = self._own_rows(rows, token_ids, positions)
        if slots.numel():
            self._engine_forward(token_ids, positions, slots, self.block_ids, kv)
            self.paged_layers += len(self.caches)

    def preview_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> bool:
        """A preview selection's tokens (``token_ids [N]`` at sorted ``positions [N]``) through
        vLLM's forward pass, each layer's attention by ``attend``; writes nothing. False when
        it did not run (no engine forward, or more tokens than one pass)."""
        if self._engine_forward is None:
            return False
        self.engine_previewed = self._engine_forward.preview(token_ids, positions, attend)
        return self.engine_previewed

    def write_layer(self, layer_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.stop > self.start:
            rows = slice(self.start, self.stop)
            self.layout.write(self.caches[layer_id], keys[rows], values[rows], self.slots)

    def write_rows(
        self, layer_id: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write ``keys``/``values`` ``[N, Hkv, D]`` of the token indices ``rows [N]``."""
        slots, keys, values = self._own_rows(rows, keys, values)
        if slots.numel():
            self.layout.write(self.caches[layer_id], keys, values, slots)

    def _own_rows(self, rows: torch.Tensor, *aligned: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(slots, *aligned)`` of the sorted token indices ``rows [N]`` this request writes
        (``start..stop-1``), each ``aligned`` tensor (``[N, ...]``) cut to the same rows:
        tokens already in vLLM's prefix cache, or beyond the claim, are left out."""
        if rows.numel() and (int(rows[0]) < self.start or int(rows[-1]) >= self.stop):
            keep = (rows >= self.start) & (rows < self.stop)
            rows, aligned = rows[keep], tuple(t[keep] for t in aligned)
        return (self.slots[rows.cpu() - self.start], *aligned)

    def attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at sorted ``positions [N]`` over the layer's paged K/V; with the
        tiled kernel, over ``keys``/``values`` ``[T, Hkv, D]`` (the same rows, contiguous)."""
        self.paged_layers += 1
        if self._tiled_attention is not None and keys is not None:
            return self._tiled_attention(q, positions, keys, values, scale)
        plan = self._plan
        if plan is None or not torch.equal(plan.positions, positions.cpu()):
            plan = self._plan = self._attention.plan(positions, self.block_ids)
        return self._attention(self.caches[layer_id], q, plan, scale)


@dataclass
class _Sliced:
    """A sliced blend in flight (``blend_layers_per_step``)."""

    spec: LoadSpec
    passes: Any  # LMCBlender.blend_passes generator
    blender: LMCBlender
    writer: _PagedWriter
    timer: Any
    started: float
    busy_s: float = 0.0
    steps: int = 0
    last: tuple[str, int] | None = None


def _tp_consistent_ops(ops: Ops) -> Ops:
    """Ops whose check-layer selection agrees across tensor-parallel ranks.

    Each rank sees only its KV heads; the per-token deviations are summed over ranks first, so
    every rank keeps the same tokens (they run the same collectives with the same shapes).
    """
    from dataclasses import replace

    from vllm.distributed.parallel_state import get_tp_group

    def topk(k_fresh, k_cached, valid_mask, ratio, num_reusable=None):
        n = k_fresh.shape[0]
        dev = (k_fresh.float().reshape(n, -1) - k_cached.float().reshape(n, -1)).pow(2).sum(-1)
        dev = get_tp_group().all_reduce(dev)
        root = dev.clamp_min(0).sqrt()[:, None]
        return kv_deviation_topk(root, torch.zeros_like(root), valid_mask, ratio, num_reusable)

    return replace(ops, kv_deviation_topk=topk)


def _tp_sum(scores: torch.Tensor) -> torch.Tensor:
    """Token scores summed over tensor-parallel ranks (each rank sees only its heads)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().all_reduce(scores.float().contiguous())


def _attention_fraction(computed: torch.Tensor, end: int, num_tokens: int) -> float:
    """Query-key pairs of the tokens ``computed [N]`` (indices) below ``end`` and of every token
    from ``end`` on, over a full prefill's ``T (T + 1) / 2``: a query at position ``p`` reads
    ``p + 1`` keys."""
    mine = computed[computed < end].to(torch.float64)
    pairs = float((mine + 1).sum()) + (end + 1 + num_tokens) * (num_tokens - end) / 2
    return pairs / (num_tokens * (num_tokens + 1) / 2)


class WorkerSide:
    """The worker-side state: model adapter, store, paged layout, blenders."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, profile: Any) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.profile = profile
        self.block_size = int(vllm_config.cache_config.block_size)
        self.caches: list[torch.Tensor] = []
        self.layer_names: list[str] = []
        self.layout: PagedLayout | None = None
        self.model: VLLMModelAdapter | None = None
        self.segments: SegmentCache | None = None
        self._writer: _PagedWriter | None = None
        self._blenders: dict[tuple, LMCBlender] = {}
        self.records: list[BlendRecord] = []
        self.stored_segments = 0
        # request -> [T] bool: rows blended from the store (not vLLM's prefix); read by save()
        self._reused: dict[str, torch.Tensor] = {}
        self.timer = PhaseTimer() if settings.profile else NO_TIMER
        self._pending: list[BlendRecord] = []  # profiled, waiting for the step's end
        self._loads_done = 0.0
        self._sliced: dict[str, _Sliced] = {}  # in flight, oldest first
        self._finished_loads: set[str] = set()  # sliced loads done (or cancelled) this step

    # -- set-up ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Order the layers' caches by layer index (``model.layers.<i>.self_attn.attn``)."""
        indexed = []
        for name, cache in kv_caches.items():
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
            indexed.append((int(match.group(1)), name, cache))
        indexed.sort()
        self.layer_names = [name for _, name, _ in indexed]
        self.caches = [cache for _, _, cache in indexed]
        if self.settings.selected_attention != "vllm":
            # build the tiled kernel now (about 30 s, the first time on a machine), not in the
            # first blended request's time to first token; whether it is used is decided later
            try:
                load_tiled_attention()
            except KernelUnavailable:
                pass  # _choose_tiled_attention logs why (or stops the engine for "tiled")
        if self.profile.kv_transfer_after_model_load:
            self._ensure_ready()

    def _ensure_ready(self) -> None:
        if self.model is not None:
            return
        if not self.caches:
            raise RuntimeError("CacheBlend: no KV caches were registered")
        model = ModelTracker.get_model(ENGINE_NAME)
        self.model = VLLMModelAdapter(model, self.vllm_config)
        if len(self.caches) != self.model.num_layers:
            raise RuntimeError(
                f"CacheBlend: {len(self.caches)} KV caches for {self.model.num_layers} layers"
            )
        self._check_rerotation()
        self.layout = self._make_layout()
        attention = self._make_attention()
        tiled = self._choose_tiled_attention() if attention is not None else None
        self._writer = _PagedWriter(
            self.layout,
            self.caches,
            attention,
            self._make_engine_forward(model, attention, tiled),
            tiled_attention=tiled,
        )
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank() if self.settings.tp_size > 1 else 0
        # the blender only reads its hits (it copies them into one buffer per request): memory
        # tiers need not copy each hit first, unless the user's extra_config says otherwise
        config = self.settings.config
        config = config.replace(extra_config={"copy_on_get": False, **config.extra_config})
        store = create_store(
            config,
            self.model.device,
            fingerprint=self.model.fingerprint,
            num_kv_heads=self.model.num_kv_heads,
            shard=self.settings.shard(rank),
            instance_id=self.settings.rank_instance(rank),
        )
        self.store = store
        self.segments = SegmentCache(store, self.model.fingerprint, self.settings.separator)
        logger.info(
            "CacheBlend worker ready: %s, %d layers, %s layout, ops %s",
            type(model).__name__,
            self.model.num_layers,
            type(self.layout).__name__,
            self._ops().name,
        )
        if self.settings.verify_on_start:
            self._verify_on_start()

    def _probe_tokens(self) -> list[int]:
        vocab = int(self.vllm_config.model_config.get_vocab_size())
        return [(100 + 37 * i) % max(vocab, 1) for i in range(96)]

    def _check_rerotation(self) -> None:
        """Refuse to start when re-rotated cached keys would not equal fresh keys: the model's
        positional encoding is not what the re-rotation assumes."""
        from lmcache_backend.blend.exactness import REROTATION_TOLERANCE, rerotation_error

        err = rerotation_error(self.model, self._probe_tokens())
        limit = REROTATION_TOLERANCE.get(self.model.dtype, REROTATION_TOLERANCE[torch.bfloat16])
        if not err <= limit:
            raise RuntimeError(
                f"CacheBlend cannot serve {type(self.model.model).__name__}: cached keys "
                f"re-rotated to new positions differ from keys computed there (relative error "
                f"{err:.2e} > {limit:.0e}); serve this model without the CacheBlend connector"
            )

    def _verify_on_start(self) -> None:
        """``verify_on_start``: the model checks of ``lmcache-backend verify``, logged once."""
        from transformers import AutoTokenizer

        from lmcache_backend.blend import exactness as verify

        mc = self.vllm_config.model_config
        tok = AutoTokenizer.from_pretrained(
            str(mc.tokenizer), trust_remote_code=bool(mc.trust_remote_code)
        )
        prompts = verify.builtin_prompts(tok, 2, self.settings.config.blend_special_str)
        checks = verify.adapter_checks(
            self.model, self.settings.separator, prompts, self.settings.config, ops=self._ops()
        )
        text = verify.format_checks("CacheBlend start-up verification", checks)
        (logger.info if verify.checks_passed(checks) else logger.warning)("%s", text)

    def _make_layout(self) -> PagedLayout:
        from vllm.platforms import current_platform

        cache = self.caches[0]
        model = self.model
        if current_platform.is_cpu():
            layer = self.vllm_config.compilation_config.static_forward_context[self.layer_names[0]]
            return CpuLayout(
                self.profile.cpu_cache_writer(),
                str(layer.isa),
                num_kv_heads=int(cache.shape[1]),
                block_size=int(cache.shape[2]),
                head_dim=model.head_dim,
                dtype=cache.dtype,
                k_scale=float(getattr(layer, "_k_scale_float", 1.0)),
                v_scale=float(getattr(layer, "_v_scale_float", 1.0)),
                kv_cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
            )
        k_cache, _ = FlashLayout.split(cache)
        return FlashLayout(int(k_cache.shape[1]), self._ops())

    def _make_attention(self) -> CpuAttention | None:
        """vLLM's CPU paged attention for the blender, where the layout and build allow it."""
        if not isinstance(self.layout, CpuLayout) or not CpuAttention.available():
            return None
        if self.model.max_exact_tokens is not None:  # sliding window: the blender falls back
            return None
        if int(self.caches[0].shape[2]) != self.block_size:
            return None
        import vllm.envs as envs

        layer = self.vllm_config.compilation_config.static_forward_context[self.layer_names[0]]
        return CpuAttention(
            str(layer.isa),
            self.model.num_heads,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.caches[0].dtype,
            bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
        )

    def _make_engine_forward(
        self, model: torch.nn.Module, attention: CpuAttention | None, tiled: TiledAttention | None
    ) -> EngineForward | None:
        """The fixed selections' pass through vLLM's forward, where paged attention runs."""
        if attention is None or not self.settings.engine_forward or not EngineForward.available():
            return None
        return EngineForward(model, self.vllm_config, self.layer_names, attention, tiled)

    def _choose_tiled_attention(self) -> TiledAttention | None:
        """The blend's tiled kernel for the selected queries, per ``selected_attention``; the one
        place that decides it (its users pass it the blend's K/V, in the model's dtype)."""
        choice = self.settings.selected_attention
        if choice == "vllm":
            return None
        if self.caches[0].dtype != torch.bfloat16:
            reason = f"the tiled kernel needs a bf16 KV cache, this one is {self.caches[0].dtype}"
        elif self.model.dtype != torch.bfloat16:
            reason = f"the tiled kernel needs a bf16 model, this one is {self.model.dtype}"
        elif self.model.head_dim % 32:
            reason = f"the tiled kernel needs a head dim multiple of 32, not {self.model.head_dim}"
        else:
            try:
                kernel = load_tiled_attention()
            except KernelUnavailable as exc:
                reason = str(exc)
            else:
                logger.info("CacheBlend: selected tokens attend with the tiled CPU kernel")
                return kernel
        if choice == "tiled":
            raise ConfigError(f"selected_attention='tiled': {reason}")
        logger.warning("CacheBlend: selected_attention=auto: %s; using vLLM's attention", reason)
        return None

    def _ops(self) -> Ops:
        ops = get_ops(self.settings.config.backend)
        return _tp_consistent_ops(ops) if self.settings.tp_size > 1 else ops

    def _blender(self, spec: LoadSpec) -> LMCBlender:
        config: BlendConfig = self.settings.config
        changes = {}
        if spec.recompute_ratios is not None:
            changes["blend_recompute_ratios"] = spec.recompute_ratios
        if spec.check_layers is not None:
            changes["blend_check_layers"] = spec.check_layers
        if spec.selection is not None:
            changes["blend_selection"] = spec.selection
        key = tuple(sorted((k, str(v)) for k, v in changes.items()))
        if key not in self._blenders:
            cfg = config.replace(**changes) if changes else config
            self._blenders[key] = LMCBlender(
                self.store,
                self._writer,
                cfg,
                self.model,
                self.settings.separator,
                self._ops(),
                score_reducer=_tp_sum if self.settings.tp_size > 1 else None,
            )
            self._blenders[key].timer = self.timer
        return self._blenders[key]

    # -- loads ----------------------------------------------------------------------------

    def _read_all_layers(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list]:
        keys, values = [], []
        for cache in self.caches:
            k, v = self.layout.read(cache, slots.to(cache.device))
            keys.append(k)
            values.append(v)
        return keys, values

    def _prepare(self, spec: LoadSpec, writer: _PagedWriter, timer: Any) -> Any:
        """Point ``writer`` at ``spec``'s rows, read vLLM's prefix rows back; returns the
        ``blend_passes`` generator (not started).

        Attention over the paged cache needs every row it computes there. A synchronous load's
        blocks cover the whole prompt: the check layers before the selection is final compute
        the tail (vLLM rewrites those rows when it computes the tail in its own forward pass,
        after the blend). A sliced load's blocks stop at the claim's end: its rows stop there and
        the blender runs with ``strict_end`` (no blend layer computes a tail token; the
        scheduler slices only the selections for which that changes nothing).
        """
        num_tokens = len(spec.token_ids)
        need = spec.end if spec.sliced else num_tokens
        attend = len(spec.block_ids) * self.block_size >= need
        stop = need if attend else spec.end
        slots = slots_for(spec.block_ids, self.block_size, 0, stop)
        prefix = self._read_all_layers(slots[: spec.prefix_len]) if spec.prefix_len else None
        timer.lap("prefix read")
        block_ids = torch.as_tensor(spec.block_ids, dtype=torch.int64) if attend else None
        writer.target(slots[spec.prefix_len :], spec.prefix_len, stop, block_ids)
        request = {"cached_prefix": prefix, "compute_end": spec.end}
        if spec.sliced:
            request["strict_end"] = True
        return self._blender(spec).blend_passes(spec.token_ids, **request)

    @torch.inference_mode()
    def load(self, spec: LoadSpec) -> BlendRecord:
        """Blend ``spec``'s prompt and write tokens ``prefix_len..end-1`` into its blocks."""
        self._ensure_ready()
        started = time.perf_counter()
        self.timer.start()
        result = run_to_end(self._prepare(spec, self._writer, self.timer))
        paged_layers = self._writer.paged_layers
        self._writer.target(torch.empty(0, dtype=torch.int64), 0, 0)
        elapsed = time.perf_counter() - started
        return self._finish(spec, result, paged_layers, elapsed, elapsed, 1, self.timer)

    def _finish(
        self,
        spec: LoadSpec,
        result: Any,
        paged_layers: int,
        busy_s: float,
        wall_s: float,
        steps: int,
        timer: Any,
    ) -> BlendRecord:
        """Keep the reused rows for the save, build and report the request's record."""
        n = len(spec.token_ids)
        reused = result.valid_mask.clone()
        reused[: spec.prefix_len] = False
        if bool(reused.any()):
            self._reused[spec.req_id] = reused
            while len(self._reused) > 4096:  # requests aborted before their save
                self._reused.pop(next(iter(self._reused)))
        layers = self.model.num_layers
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
            blend_ms=busy_s * 1000.0,
            selected_digest=hashlib.sha256(
                result.recomputed.to(torch.int64).numpy().tobytes()
            ).hexdigest()[:16],
            vllm_attention_layers=paged_layers,
            attention_fraction=_attention_fraction(result.recomputed, spec.end, n),
            blend_steps=steps,
            blend_wall_ms=wall_s * 1000.0,
        )
        if self.settings.profile and not spec.sliced:
            record.profile = timer.milliseconds()
            self._pending.append(record)
            self._loads_done = time.perf_counter()
        else:
            if self.settings.profile:  # the tail comes in a later step: no "vllm step"
                record.profile = timer.milliseconds()
            self._report(record)
        return record

    # -- sliced loads ---------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, spec: LoadSpec) -> None:
        """Start ``spec``'s sliced blend; it advances in :meth:`advance`."""
        self._ensure_ready()
        started = time.perf_counter()
        timer = PhaseTimer() if self.settings.profile else NO_TIMER
        writer = _PagedWriter(
            self.layout,
            self.caches,
            self._writer.attention_op,
            self._writer.engine_forward,
            blend_in_layers=True,
            tiled_attention=self._writer.tiled_attention,
        )
        passes = self._prepare(spec, writer, timer)
        job = _Sliced(spec, passes, self._blender(spec), writer, timer, started)
        job.busy_s = time.perf_counter() - started
        self._sliced[spec.req_id] = job

    def cancel(self, req_id: str) -> None:
        """Drop the blend of a request finished (aborted) while it was in flight: nothing writes
        its blocks again; it is reported in ``finished_recving`` so vLLM frees them. A request
        whose blend already completed (and was reported) is not reported again."""
        job = self._sliced.pop(req_id, None)
        if job is None:
            return
        job.passes.close()
        self._finished_loads.add(req_id)
        logger.info(
            "CacheBlend request %s finished while blending: blend dropped after %d steps",
            req_id,
            job.steps,
        )

    @torch.inference_mode()
    def advance(self) -> None:
        """Run ``blend_layers_per_step`` layer passes of the blends in flight, oldest first;
        a blend that completes is reported in ``finished_recving``. A preview through vLLM's
        forward pass (all its layers in one pass, about as long as a few blend layers) ends the
        step it ran in. The count never depends on time: tensor-parallel ranks run the same
        passes (and collectives) in the same order."""
        budget = self.settings.blend_layers_per_step
        stepped: set[str] = set()
        last_layer = self.model.num_layers - 1
        while self._sliced and budget > 0:
            job = next(iter(self._sliced.values()))
            if job.spec.req_id not in stepped:
                stepped.add(job.spec.req_id)
                job.steps += 1
            if self._step(job):
                budget -= 1
                if job.last == ("preview", last_layer) and job.writer.engine_previewed:
                    budget = 0
            if budget == 0 and job.last == ("blend", last_layer):
                self._step(job)  # nothing left but the result: finish it this step

    def _step(self, job: _Sliced) -> bool:
        """One pass of ``job``, its writer and timer in place; False when it completed (the
        call that only returned the result)."""
        started = time.perf_counter()
        blender = job.blender
        blender.timer, blender.gpu_connector = job.timer, job.writer
        job.timer.mark()
        try:
            job.last = next(job.passes)
        except StopIteration as done:
            result = done.value
        else:
            return True
        finally:
            blender.timer, blender.gpu_connector = self.timer, self._writer
            job.busy_s += time.perf_counter() - started
        rid = job.spec.req_id
        del self._sliced[rid]
        wall = time.perf_counter() - job.started
        paged = job.writer.paged_layers
        self._finish(job.spec, result, paged, job.busy_s, wall, job.steps, job.timer)
        self._finished_loads.add(rid)
        return False

    def take_finished_loads(self) -> set[str] | None:
        """Sliced loads completed or cancelled since the last call (``finished_recving``)."""
        if not self._finished_loads:
            return None
        done, self._finished_loads = self._finished_loads, set()
        return done

    def finish_step(self) -> None:
        """After the step's forward pass: report the profiled records with vLLM's step time."""
        if not self._pending:
            return
        step_ms = (time.perf_counter() - self._loads_done) * 1000.0
        for record in self._pending:
            record.profile["vllm step"] = round(step_ms, 3)
            self._report(record)
        self._pending = []

    def _report(self, record: BlendRecord) -> None:
        self.records.append(record)
        logger.info(
            "CacheBlend request %s: %d tokens, %d claimed, %d reusable (%d from the prefix "
            "cache), %d reusable recomputed (%.1f%%), %.0f%% token-layers, %.0f ms%s",
            record.req_id,
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
        if self.settings.stats_file:
            try:
                with open(self.settings.stats_file, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(asdict(record)) + "\n")
            except OSError as exc:
                logger.warning("cannot append to stats_file %s: %s", self.settings.stats_file, exc)

    # -- saves ----------------------------------------------------------------------------

    @torch.inference_mode()
    def save(self, spec: SaveSpec) -> int:
        """Store the segments of ``spec``'s prompt the store lacks; returns how many."""
        self._ensure_ready()
        tokens = spec.token_ids
        reused = self._reused.pop(spec.req_id, None)
        # cached() covers the chunks only: the query tail is never stored. A unit holding rows
        # blended from the store is not stored either: its K/V are not a computation of its own
        # (separator-free blocks can overlap a reused block found at another offset).
        missing = [
            seg
            for seg, hit in self.segments.cached(tokens)
            if not hit and (reused is None or not bool(reused[seg.start : seg.end].any()))
        ]
        if not missing:
            return 0
        slots = slots_for(spec.block_ids, self.block_size, 0, len(tokens))
        stored = 0
        for segment in missing:  # read back only the rows of the segments to store
            keys, values = self._read_all_layers(slots[segment.start : segment.end])
            stored += self.segments.store_segment(tokens, segment, keys, values)
        self.stored_segments += stored
        logger.debug("request %s: stored %d segments", spec.req_id, stored)
        return stored

    def shutdown(self) -> None:
        """Close the store; drop the index markers of tiers that die with this process."""
        store = getattr(self, "store", None)
        if store is None:
            return
        store.close()
        index = getattr(store, "index", None)
        if index is not None and all(t.name in ("cpu", "device") for t in store.local_tiers):
            index.clear()
            try:
                os.rmdir(index.folder)
            except OSError:
                pass
