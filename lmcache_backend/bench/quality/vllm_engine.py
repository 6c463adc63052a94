"""The benchmark inside vLLM with the CacheBlend connector: :class:`VLLMEngine`."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_backend.bench.quality.engines import Answer, PrefillRun
from lmcache_backend.bench.quality.strategies import BLEND, FULL, PREFIX, Strategy
from lmcache_backend.blend.segmenting import shaped_prompt


class VLLMEngine:
    """The benchmark inside one vLLM engine with the CacheBlend connector.

    Every strategy is a request option: full prefill and prefix caching opt out of blending
    (``kv_transfer_params={"blend": false}``), CacheBlend sets its ratios and check layers per
    request. vLLM's prefix cache is on but emptied before every request, so a repeat never reuses
    the previous run; prefix caching first re-runs the original prompt (untimed) so that its
    blocks are what the asked prompt can hit. TTFT is the latency of a one-token request, as a
    client sees it. The EPIC selection has no request option and is not run.

    The answer and the teacher-forced distributions of a strategy (:meth:`decode`,
    :meth:`forced_logits`) come from requests of their own with the strategy's options, each on an
    empty prefix cache: a blend is deterministic, so each one blends exactly as the prefill did
    (reading the prefill's K/V from the prefix cache instead would recompute, in full, the cached
    chunks' tokens in the prompt's last partial block).

    Each :meth:`reset` starts a new ``cache_salt`` that every later request carries: the
    connector's segment store lives in the worker and cannot be emptied from here, and passages
    recur across examples (MuSiQue's do), so without it a chunk stored by an earlier example,
    in that example's context, would be reused instead of the one this example's warm-up stores.
    """

    name = "vllm"

    def __init__(self, model_path: str, model_name: str = "") -> None:
        import tempfile

        from transformers import AutoConfig, AutoTokenizer

        from lmcache_backend.bench.quality.forced_answer import FQCN as FORCED_ANSWER
        from lmcache_backend.config import load_config
        from lmcache_backend.integration.vllm.offline import offline_engine
        from lmcache_backend.settings.writer import STARTED_ENGINE, export

        export(defaults=STARTED_ENGINE)
        self.config = load_config()
        self._stats = os.path.join(tempfile.mkdtemp(prefix="lmcache-bench-"), "stats.jsonl")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model_config = AutoConfig.from_pretrained(model_path)
        self.num_layers = int(model_config.num_hidden_layers)
        # the model's whole context (long-context sets, dev@32000), 32k at most
        context = getattr(model_config, "max_position_embeddings", None) or 8192
        self.model_name = model_name or model_path
        self.llm = offline_engine(
            model_path,
            stats_file=self._stats,
            enable_prefix_caching=True,
            enforce_eager=False,
            max_model_len=min(int(context), 32768),
            max_logprobs=-1,  # the full first-token distribution, for the KL
            logits_processors=[FORCED_ANSWER],  # teacher-forced answers, for their KL
        )
        self._warm_ids: list[int] = []
        self._resets = 0
        self._salt = "bench-0"

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

    #: how examples are posed: one of :data:`~lmcache_backend.blend.segmenting.PROMPT_SHAPES`
    prompt_shape = "separator"

    def prompt_ids(self, system: str, chunks: Sequence[str], question: str) -> list[int]:
        return shaped_prompt(
            self.tokenizer,
            self.prompt_shape,
            system,
            chunks,
            question,
            self.config.blend_special_str,
        )

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_ids(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def supports(self, strategy: Strategy) -> bool:
        return strategy.kind in (FULL, PREFIX, BLEND)

    def _generate(self, token_ids: Sequence[int], params: dict, max_tokens: int, logprobs=None):
        from lmcache_backend.integration.vllm.offline import generate_one

        # a full distribution needs no text: vLLM would decode each of its tokens
        return generate_one(
            self.llm,
            token_ids,
            max_tokens,
            params,
            logprobs,
            detokenize=logprobs is None,
            cache_salt=self._salt,
        )

    @staticmethod
    def _params(strategy: Strategy) -> dict:
        if strategy.kind == BLEND:
            params = {
                "blend_recompute_ratios": list(strategy.ratios),
                "blend_check_layers": list(strategy.check_layers),
            }
            if strategy.selection:
                params["blend_selection"] = strategy.selection
            if strategy.read_share is not None:
                params["blend_min_read_share"] = strategy.read_share
            if strategy.max_divergence is not None:
                params["blend_max_divergence"] = strategy.max_divergence
            return params
        return {"blend": False}

    def reset(self) -> None:
        # The connector's segment store lives in the worker: a new salt leaves every earlier
        # entry out of reach (see the class docstring).
        self.llm.reset_prefix_cache()
        self._warm_ids = []
        self._resets += 1
        self._salt = f"bench-{self._resets}"

    def warm(self, token_ids: Sequence[int]) -> None:
        self._warm_ids = list(token_ids)
        self._generate(token_ids, {"blend": False}, 1)  # computes and stores every segment

    def probe(self, token_ids: Sequence[int], probes: int) -> None:
        from lmcache_backend.settings.vllm_keys import STALENESS_PROBES

        self._generate(token_ids, {"blend": False, STALENESS_PROBES: probes}, 1)

    def _prepare(self, strategy: Strategy) -> None:
        """Empty vLLM's prefix cache (prefix caching: fill it with the warm-up prompt)."""
        self.llm.reset_prefix_cache()
        if strategy.kind == PREFIX and self._warm_ids:
            self._generate(self._warm_ids, {"blend": False}, 1)

    def _last_record(self) -> dict | None:
        from lmcache_backend.integration.vllm.offline import read_records

        records = read_records(self._stats)
        return records[-1] if records else None

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
            run.read_share = record.get("read_share")
            run.divergence = record.get("divergence")
        elif strategy.kind == BLEND:
            run.fallback_reason = "the connector did not claim the prompt"
        return run

    def decode(self, token_ids: Sequence[int], run: PrefillRun, max_new_tokens: int) -> Answer:
        strategy: Strategy = run.state
        self._prepare(strategy)
        out = self._generate(token_ids, self._params(strategy), max_new_tokens).outputs[0]
        ids = list(out.token_ids)
        if ids and out.finish_reason == "stop" and out.stop_reason is None:
            ids = ids[:-1]  # the end-of-sequence token that stopped it
        return Answer(out.text, ids)

    def forced_logits(
        self, token_ids: Sequence[int], run: PrefillRun, answer_ids: Sequence[int]
    ) -> torch.Tensor:
        from vllm import SamplingParams

        from lmcache_backend.bench.quality.forced_answer import FORCED_TOKENS

        answer = list(answer_ids)
        rows = torch.full((len(answer), len(self.tokenizer)), float("-inf"))
        if not answer:
            return rows
        strategy: Strategy = run.state
        self._prepare(strategy)
        sampling = SamplingParams(
            temperature=0,
            max_tokens=len(answer),
            ignore_eos=True,
            logprobs=-1,
            flat_logprobs=True,  # a few flat lists instead of a dict per vocabulary entry
            detokenize=False,  # no text, for the answer or for each entry of the distribution
            extra_args={"kv_transfer_params": self._params(strategy), FORCED_TOKENS: answer},
        )
        prompt = {"prompt_token_ids": list(token_ids), "cache_salt": self._salt}
        out = self.llm.generate([prompt], sampling, use_tqdm=False)[0].outputs[0]
        if list(out.token_ids) != answer:
            raise RuntimeError(f"forced answer {answer} came out as {list(out.token_ids)}")
        flat = out.logprobs
        for step in range(len(answer)):
            lo, hi = flat.start_indices[step], flat.end_indices[step]
            ids = torch.tensor(flat.token_ids[lo:hi], dtype=torch.int64)
            keep = ids < rows.shape[1]
            rows[step, ids[keep]] = torch.tensor(flat.logprobs[lo:hi])[keep]
        return rows

    def cache_bytes(self, strategy: Strategy) -> int | None:
        return 0 if strategy.kind == FULL else None  # the stores live in the worker
