"""Which vLLM decoder layers the CacheBlend adapter (:mod:`lmcache_backend.models.vllm`) accepts,
refusing the others with one line, and what it reads from them: rotary op, sliding window."""

from __future__ import annotations

from typing import Any

import torch

from lmcache_backend.models.base import UnsupportedModelError

#: architectures with Gemma's norm layout (post-attention norm before the residual add,
#: pre/post feed-forward norms): see the module docstring
GEMMA_NORMS = ("Gemma3ForCausalLM",)
#: Gemma 3 layer kinds (``config.layer_types``) the adapter reproduces
GEMMA3_LAYER_KINDS = ("full_attention", "sliding_attention")


def cpu_rotary_op() -> Any:
    """vLLM's ``_custom_ops`` when it has the CPU rotary op, else None."""
    from lmcache_backend.device import engine_platform

    try:
        from vllm import _custom_ops
    except ImportError:
        return None
    if engine_platform() != "cpu" or not hasattr(_custom_ops, "rotary_embedding"):
        return None
    return _custom_ops


def check_rotary(arch: str, attn: Any, rotary: Any) -> None:
    """Refuse attention whose positional encoding is not one rotation per position.

    Re-rotating a cached key needs ``rope(k, p) = R(p) k`` (times a constant factor, see
    :func:`~lmcache_backend.models.base.pure_rotation_table`): the rotation tables of plain,
    linear, dynamic-NTK, Llama-3 and YaRN scaling qualify. Multimodal RoPE (several position
    streams), dual-chunk RoPE and Llama-4-style position-dependent query scaling do not.
    """
    name = type(rotary).__name__
    problem = None
    if not hasattr(rotary, "_compute_cos_sin_cache") or not hasattr(rotary, "is_neox_style"):
        problem = f"its rotary embedding {name} exposes no rotation table"
    elif "MRotary" in name or "DualChunk" in name or "Phi3LongRoPE" in name:
        problem = f"its rotary embedding {name} is not one rotation per position"
    elif getattr(attn, "do_llama_4_scaling", False):
        problem = "it scales queries by position (llama_4_scaling)"
    if problem is not None:
        raise UnsupportedModelError(
            f"CacheBlend cannot re-rotate cached keys of this {arch}: {problem}; "
            "serve it without the CacheBlend connector"
        )


def check_layers(arch: str, layers: Any, hf: Any) -> None:
    """Refuse, with one line naming it, a layer kind the adapter cannot reproduce exactly:
    attention logit softcapping, attention that is not causal, a Gemma 3 layer kind other
    than sliding / full attention, a layer without the norms of its architecture."""
    serve = "serve it without the CacheBlend connector"
    gemma = arch in GEMMA_NORMS
    if gemma:
        for index, kind in enumerate(getattr(hf, "layer_types", None) or []):
            if kind not in GEMMA3_LAYER_KINDS:
                raise UnsupportedModelError(
                    f"CacheBlend cannot reproduce layer {index} of this {arch}: layer kind "
                    f"{kind!r} (supported: {', '.join(GEMMA3_LAYER_KINDS)}); {serve}"
                )
    norms = ("input_layernorm", "post_attention_layernorm", "mlp")
    if gemma:
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    for index, layer in enumerate(layers):
        missing = [name for name in norms if not hasattr(layer, name)]
        attention = getattr(getattr(layer, "self_attn", None), "attn", None)
        problem = None
        if missing:
            problem = f"it has no {', '.join(missing)}"
        elif attention is None:
            problem = "its attention has no vLLM attention layer"
        elif getattr(attention, "attn_type", "decoder") != "decoder":
            problem = f"its attention is {attention.attn_type}, not causal decoder attention"
        elif getattr(getattr(attention, "impl", None), "logits_soft_cap", None):
            problem = "attention logit softcapping is not reproduced"
        if problem is not None:
            raise UnsupportedModelError(
                f"CacheBlend cannot reproduce layer {index} of this {arch}: {problem}; {serve}"
            )


def native_rotary(rotary: Any) -> bool:
    """Whether ``rotary`` computes plain RoPE from its ``cos_sin_cache`` (vLLM's
    ``RotaryEmbedding`` or a subclass that only builds another table: Llama-3, YaRN, linear,
    dynamic-NTK scaling), so vLLM's fused CPU op computes the same thing."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return False
    kind = type(rotary)
    return (
        isinstance(rotary, RotaryEmbedding)
        and kind.forward_native is RotaryEmbedding.forward_native
        and kind.forward_static is RotaryEmbedding.forward_static
        and isinstance(getattr(rotary, "cos_sin_cache", None), torch.Tensor)
    )


def attention_window(layer: Any) -> int | None:
    """The sliding window vLLM's attention layer of ``layer`` applies (a query at ``p`` sees
    keys ``p - window + 1 .. p``), or None."""
    window = getattr(layer.self_attn.attn, "sliding_window", None)
    return int(window) if window else None
