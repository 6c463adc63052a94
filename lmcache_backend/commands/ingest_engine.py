"""The engine ``lmcache-backend ingest`` computes chunks with: vLLM with the CacheBlend connector,
configured as ``serve`` is (``LMCACHE_*``), and the store keys that engine uses.

The model's fingerprint (part of every key) comes from vLLM's configuration before the engine
starts, so a run that finds every chunk stored already never starts it.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from typing import Any

from lmcache_backend.config import ConfigError, load_config


class IngestEngine:
    """vLLM (started on first use) and the lasting tiers of the configuration.

    Args:
        model: as the engines are started with (None: the embedded SmolLM2).
        dtype: vLLM's ``--dtype``.

    Raises:
        ConfigError: no tier outlives the command (neither ``remote_url`` nor a disk tier), or a
            storage setting is invalid.
    """

    def __init__(self, model: str | None, dtype: str = "auto") -> None:
        from transformers import AutoTokenizer

        from lmcache_backend.blend.segments.patterns import segment_pattern
        from lmcache_backend.data.embedded import resolve_model
        from lmcache_backend.storage.factory import create_shared_tier, disk_folder

        self.model = resolve_model(model)
        self.dtype = dtype
        self.config = load_config()
        folder = disk_folder(self.config) if self.config.max_local_disk_size > 0 else None
        self.remote = create_shared_tier(self.config)
        self.folder = folder
        self.lasting = [name for name, on in (("redis", self.remote), ("disk", folder)) if on]
        if not self.lasting:
            raise ConfigError(
                "ingest writes to the tiers that outlive it: set remote_url (LMCACHE_REMOTE_URL) "
                "or local_disk with max_local_disk_size > 0"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.pattern = segment_pattern(
            self.tokenizer,
            self.config.blend_special_str,
            self.config.blend_block_size,
            self.config.blend_segmentation,
        )
        #: the longest prompt the engine must take (set before the first prefill)
        self.max_model_len = 4096
        self._llm: Any = None
        self.fingerprint = self._fingerprint()

    def __enter__(self) -> IngestEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _engine_args(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": True,
            "enable_prefix_caching": True,  # the system part, once per batch
        }

    def _fingerprint(self) -> Any:
        from vllm.engine.arg_utils import EngineArgs

        from lmcache_backend.models.vllm import vllm_fingerprint

        return vllm_fingerprint(EngineArgs(**self._engine_args()).create_engine_config())

    def keys_of(self, token_ids: list[int], spans: list[tuple[int, int]]) -> list[str]:
        from lmcache_backend.storage.segments import segment_keys

        return segment_keys(self.fingerprint, token_ids, spans)

    def persisted(self, keys: Sequence[str]) -> list[bool]:
        """Whether every lasting tier holds each key."""
        found = [True] * len(keys)
        if self.remote is not None:
            found = [a and b for a, b in zip(found, self.remote.contains_many(list(keys)))]
        if self.folder is not None:
            from lmcache_backend.storage.disk import SUFFIX

            found = [
                a and os.path.exists(os.path.join(self.folder, k + SUFFIX))
                for a, k in zip(found, keys)
            ]
        return found

    def bytes_per_token(self) -> dict[str, int]:
        """Per lasting tier, the bytes of one token's K and V (every layer)."""
        from lmcache_backend.storage.serde import dtype_from_name

        fp = self.fingerprint
        dtype = dtype_from_name(fp.dtype)
        size = dtype.itemsize if dtype is not None else 2
        per_token = 2 * fp.num_layers * fp.num_kv_heads * fp.head_dim * size
        return dict.fromkeys(self.lasting, per_token)

    def prior_bytes_per_token(self) -> int:
        """The bytes one token's staleness prior takes in an entry (fp16, one per layer)."""
        return 2 * self.fingerprint.num_layers

    def probe(self, prompts: list[list[int]], probes: int | None = None) -> None:
        """Send ``prompts`` as staleness probes (``lmcache.staleness_probes``): nothing is
        stored; the stored chunks they hold get their prior after ``probes`` probes (the
        engine's ``probes``, set by the command, when None)."""
        from lmcache_backend.settings.vllm_keys import STALENESS_PROBES

        self.prefill(prompts, {"blend": False, STALENESS_PROBES: probes or self.probes})

    #: the probes after which a probed chunk gets its prior (``--staleness-probes``)
    probes = 1

    def prefill(self, prompts: list[list[int]], params: dict | None = None) -> None:
        """Compute ``prompts`` (one token each, blending off): the connector stores their units
        (``params``: other ``kv_transfer_params``)."""
        from vllm import SamplingParams

        if self._llm is None:
            self._start()
        sampling = SamplingParams(
            temperature=0,
            max_tokens=1,
            extra_args={"kv_transfer_params": params or {"blend": False}},
        )
        self._llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)

    def _start(self) -> None:
        from lmcache_backend.integration.vllm.offline import offline_engine
        from lmcache_backend.models.vllm import vllm_fingerprint

        args = self._engine_args()
        model = args.pop("model")
        # the connector stores a prompt's units only where blending is on (each request here
        # opts out of the blend itself); kv_connector_extra_config overrides the environment
        extra = {"instance_id": f"ingest-{os.getpid()}", "enable_blending": True}
        self._llm = offline_engine(model, extra_config=extra, **args)
        started = vllm_fingerprint(self._llm.llm_engine.vllm_config)
        if started != self.fingerprint:  # the keys checked would not be the keys stored
            raise RuntimeError(f"the engine's fingerprint {started} is not {self.fingerprint}")

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm
            gc.collect()
