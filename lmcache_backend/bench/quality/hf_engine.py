"""The benchmark on HF transformers: :class:`HFEngine`, in process, every strategy."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_backend.bench.quality.engines import (
    Answer,
    PrefillRun,
    common_prefix_length,
    epic_recompute_mask,
    oracle_recompute_mask,
    reusable_prefix,
)
from lmcache_backend.bench.quality.strategies import BLEND, EPIC, FULL, ORACLE, PREFIX, Strategy
from lmcache_backend.blend.segmenting import shaped_prompt


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
        #: the last prompt's full-prefill and naive-reuse K/V (the deviation oracle's inputs),
        #: kept for the next oracle strategy on the same prompt
        self._deviation_inputs: tuple[list[int], Any, Any] | None = None

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

    #: how examples are posed: one of :data:`~lmcache_backend.blend.segmenting.PROMPT_SHAPES`
    prompt_shape = "separator"

    def prompt_ids(self, system: str, chunks: Sequence[str], question: str) -> list[int]:
        return shaped_prompt(
            self.tokenizer,
            self.prompt_shape,
            system,
            chunks,
            question,
            self.core.config.blend_special_str,
        )

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_ids(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def reset(self) -> None:
        self.core.store.clear()
        self._prompts.clear()
        self._deviation_inputs = None

    def warm(self, token_ids: Sequence[int]) -> None:
        tokens = list(token_ids)
        prefill = self.core.full_prefill(tokens)
        self.core.store_prompt(tokens, prefill)
        # What a prefix cache would hold after serving this prompt.
        self._prompts.append((tokens, prefill.keys, prefill.values))

    def probe(self, token_ids: Sequence[int], probes: int) -> None:
        self.core.probe(token_ids, probes)

    def _config(self, strategy: Strategy):
        """The request settings of ``strategy``."""
        config = self.core.config
        if strategy.kind != BLEND:
            return config
        return config.replace(
            blend_recompute_ratios=list(strategy.ratios),
            blend_check_layers=list(strategy.check_layers),
            blend_selection=strategy.selection or config.blend_selection,
            blend_min_read_share=(
                config.blend_min_read_share if strategy.read_share is None else strategy.read_share
            ),
            blend_max_divergence=(
                config.blend_max_divergence
                if strategy.max_divergence is None
                else strategy.max_divergence
            ),
        )

    def supports(self, strategy: Strategy) -> bool:
        return strategy.kind in (FULL, PREFIX, BLEND, EPIC, ORACLE)

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
        if strategy.kind in (BLEND, EPIC, ORACLE):
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
        elif strategy.kind == ORACLE:  # its time includes the full prefill it looks at
            result = blender.blend(tokens, recompute=self._oracle_mask(strategy, tokens))
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
            read_share=result.read_share,
            divergence=result.divergence,
        )

    def _oracle_mask(self, strategy: Strategy, tokens: list[int]) -> torch.Tensor:
        """The deviation oracle's selection for ``tokens`` (see :func:`oracle_recompute_mask`);
        the full prefill and naive reuse it compares are computed once per prompt and store."""
        if self._deviation_inputs is None or self._deviation_inputs[0] != tokens:
            naive_config = self.core.config.replace(blend_recompute_ratios=[0.0])
            naive = self.core.blender.blend(tokens, config=naive_config)
            self._deviation_inputs = (tokens, self.core.full_prefill(tokens), naive)
        _, full, naive = self._deviation_inputs
        count = int(strategy.ratios[0] * naive.num_reusable)
        return oracle_recompute_mask(
            (full.keys, full.values), (naive.keys, naive.values), naive.valid_mask, count
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
        # every row kept: the prompt's K/V are read back whole for decoding below
        cache = kv_to_dynamic_cache(
            self.model, [k[:reuse] for k in keys], [v[:reuse] for v in values], every_row=True
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

    def decode(self, token_ids: Sequence[int], run: PrefillRun, max_new_tokens: int) -> Answer:
        generation = self.core.decode(list(token_ids), run.state, max_new_tokens)
        return Answer(generation.text, list(generation.token_ids))

    @torch.no_grad()
    def forced_logits(
        self, token_ids: Sequence[int], run: PrefillRun, answer_ids: Sequence[int]
    ) -> torch.Tensor:
        from lmcache_backend.integration.hf.engine import kv_to_dynamic_cache

        prefill, answer = run.state, list(answer_ids)
        rows = [prefill.logits.float()[None]]
        if len(answer) > 1:
            # the decoding cache (windowed layers keep their window), as decode() builds it
            cache = kv_to_dynamic_cache(self.model, prefill.keys, prefill.values)
            ids = torch.tensor([answer[:-1]], device=self.model.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            rows.append(out.logits[0].float())
        return torch.cat(rows)[: len(answer)]

    def cache_bytes(self, strategy: Strategy) -> int:
        if strategy.kind == FULL:
            return 0
        if strategy.kind == PREFIX:
            return sum(
                sum(k.nbytes + v.nbytes for k, v in zip(keys, values))
                for _, keys, values in self._prompts
            )
        return int(self.core.store.nbytes)
