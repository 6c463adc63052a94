"""Checks the worker runs once its model is known: the re-rotation (always) and, with
``verify_on_start``, the model checks of ``lmcache-backend verify``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lmcache_backend.blend.exactness import (
    REROTATION_TOLERANCE,
    adapter_checks,
    builtin_prompts,
    checks_passed,
    format_checks,
    rerotation_error,
)
from lmcache_backend.integration.vllm.settings import ConnectorSettings
from lmcache_backend.models.vllm import VLLMModelAdapter
from lmcache_backend.ops import Ops

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def probe_tokens(vllm_config: VllmConfig) -> list[int]:
    """96 token ids spread over the model's vocabulary."""
    vocab = int(vllm_config.model_config.get_vocab_size())
    return [(100 + 37 * i) % max(vocab, 1) for i in range(96)]


def check_rerotation(model: VLLMModelAdapter, vllm_config: VllmConfig) -> None:
    """Refuse to start when re-rotated cached keys would not equal fresh keys: the model's
    positional encoding is not what the re-rotation assumes.

    Every kind of layer (rotation table and window: Gemma 3's local and global layers) is
    checked on its first layer.

    Raises:
        RuntimeError: naming the model, the layer and the error found.
    """
    limit = REROTATION_TOLERANCE.get(model.dtype, REROTATION_TOLERANCE[torch.bfloat16])
    for kind, layer in model.layer_kinds():
        err = rerotation_error(model, probe_tokens(vllm_config), layer=layer)
        if not err <= limit:
            where = f" ({kind})" if kind else ""
            raise RuntimeError(
                f"CacheBlend cannot serve {type(model.model).__name__}: cached keys{where} "
                f"re-rotated to new positions differ from keys computed there (relative error "
                f"{err:.2e} > {limit:.0e}); serve this model without the CacheBlend connector"
            )


def verify_on_start(
    model: VLLMModelAdapter, vllm_config: VllmConfig, settings: ConnectorSettings, ops: Ops
) -> None:
    """``verify_on_start``: the model checks of ``lmcache-backend verify``, logged once."""
    from transformers import AutoTokenizer

    mc = vllm_config.model_config
    tok = AutoTokenizer.from_pretrained(
        str(mc.tokenizer), trust_remote_code=bool(mc.trust_remote_code)
    )
    prompts = builtin_prompts(tok, 2, settings.config.blend_special_str)
    checks = adapter_checks(model, settings.separator, prompts, settings.config, ops=ops)
    text = format_checks("CacheBlend start-up verification", checks)
    (logger.info if checks_passed(checks) else logger.warning)("%s", text)
