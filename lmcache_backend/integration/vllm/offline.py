"""vLLM's offline engine (``vllm.LLM``) with the CacheBlend connector, as the benchmarks, ``verify``
and the tests run it, and the two things they do with it: send one request with its
``kv_transfer_params`` and read the connector's records back.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from lmcache_backend.integration.vllm import kv_transfer_config


def offline_engine(
    model: str,
    *,
    stats_file: str | None = None,
    connector: bool = True,
    enable_prefix_caching: bool = False,
    enforce_eager: bool = True,
    max_model_len: int = 8192,
    seed: int = 0,
    extra_config: dict[str, Any] | None = None,
    **llm_kwargs: Any,
) -> Any:
    """A ``vllm.LLM`` serving ``model`` with the connector.

    Args:
        model: the model's path.
        stats_file: where the connector appends one JSON line per blended request.
        connector: False: the same engine without the connector (vLLM alone).
        enable_prefix_caching, enforce_eager, max_model_len, seed: as ``vllm.LLM``'s.
        extra_config: further ``kv_connector_extra_config`` keys (``time_phases``, ...).
        llm_kwargs: anything else ``vllm.LLM`` takes (``dtype``, ``tensor_parallel_size``, ...).
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if connector:
        kv = KVTransferConfig(**kv_transfer_config(stats_file, **(extra_config or {})))
    return LLM(
        model=model,
        kv_transfer_config=kv,
        enable_prefix_caching=enable_prefix_caching,
        enforce_eager=enforce_eager,
        max_model_len=max_model_len,
        seed=seed,
        **llm_kwargs,
    )


def generate_one(
    llm: Any,
    token_ids: Sequence[int],
    max_tokens: int,
    params: dict | None = None,
    logprobs: int | None = None,
    detokenize: bool = True,
    cache_salt: str | None = None,
) -> Any:
    """One greedy request of ``token_ids`` with ``params`` as its ``kv_transfer_params``
    (None: the engine's settings); its ``RequestOutput``. ``detokenize=False``: no text (and no
    text for each log-probability's token: vLLM decodes every one of a full distribution's).
    ``cache_salt``: the request's key namespace (vLLM's tenant isolation), None: unsalted."""
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        logprobs=logprobs,
        detokenize=detokenize,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return llm.generate([prompt], sampling, use_tqdm=False)[0]


def read_records(stats_file: str, left_to_vllm: bool = False) -> list[dict]:
    """The connector's records in ``stats_file``, oldest first: one per blended request, and
    with ``left_to_vllm`` also the lines of the requests it left to vLLM (``"blended": false``,
    with their ``reason``)."""
    if not os.path.exists(stats_file):
        return []
    with open(stats_file, encoding="utf-8") as fh:
        lines = [json.loads(line) for line in fh if line.strip()]
    return lines if left_to_vllm else [r for r in lines if r.get("blended", True)]
