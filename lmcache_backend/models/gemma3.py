"""Model adapter for Gemma 3 text models (``model_type`` ``gemma3_text``, transformers'
``Gemma3ForCausalLM``), reproducing its decoder layer exactly.

What differs from the Llama layout (:mod:`lmcache_backend.models.hf`):

* four norms per layer, Gemma's RMSNorm ``x * (1 + weight)`` in fp32: ``input_layernorm``;
  ``post_attention_layernorm`` on the attention output *before* the residual add;
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the GELU-tanh MLP;
* ``q_norm``/``k_norm`` over the head dim before RoPE (the shared ``qkv`` step applies them);
* embeddings scaled by ``sqrt(hidden_size)`` (inside HF's embedding module);
* softmax scale ``query_pre_attn_scalar ** -0.5``;
* ``layer_types``: ``sliding_attention`` layers attend the last ``sliding_window`` positions
  (a query at ``p`` sees keys ``p - window + 1 .. p``) and rotate with the local RoPE base
  (``rope_local_base_freq``, 10k); ``full_attention`` layers see every earlier key and rotate
  with the global one (``rope_theta``, 1M, with any ``rope_scaling``). Each layer kind has its
  rotation table (:meth:`Gemma3Adapter.rotation_table`) and window
  (:meth:`Gemma3Adapter.sliding_window`);
* an optional final logit softcap (``final_logit_softcapping``: None in Gemma 3).

Refused with one line (:class:`~lmcache_backend.models.base.UnsupportedModelError`): a layer
kind other than those two, attention logit softcapping, bidirectional attention, RoPE whose
frequencies change with the length (``dynamic``, ``longrope``).
"""

from __future__ import annotations

import torch

from lmcache_backend.models.base import UnsupportedModelError, rope_cos_sin_cache
from lmcache_backend.models.hf import HFModelAdapter

#: the layer kinds (``config.layer_types``) the adapter reproduces
LAYER_KINDS = ("full_attention", "sliding_attention")
#: RoPE types whose frequencies depend on the sequence length: one table cannot hold them
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * config.num_hidden_layers


class Gemma3Adapter(HFModelAdapter):
    """:class:`HFModelAdapter` for ``gemma3_text`` models (built by ``HFModelAdapter(model)``).

    Raises:
        UnsupportedModelError: a layer kind or setting the blender cannot reproduce exactly.
    """

    def _check_config(self, config) -> None:
        name = f"model_type {config.model_type!r}"
        for layer, kind in enumerate(_layer_types(config)):
            if kind not in LAYER_KINDS:
                raise UnsupportedModelError(
                    f"{name}: layer kind {kind!r} (layer {layer}) is not supported "
                    f"(supported: {', '.join(LAYER_KINDS)})"
                )
        softcap = getattr(config, "attn_logit_softcapping", None)
        if softcap is not None:
            raise UnsupportedModelError(
                f"{name}: attention logit softcapping (attn_logit_softcapping={softcap}) is "
                "not supported"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{name}: bidirectional attention is not supported")
        params = getattr(config, "rope_parameters", None) or {}
        for kind in sorted(set(_layer_types(config))):
            rope_type = (params.get(kind) or {}).get("rope_type", "default")
            if rope_type in _LENGTH_DEPENDENT_ROPE:
                raise UnsupportedModelError(
                    f"{name}: {rope_type!r} RoPE on {kind} layers changes frequencies with "
                    "length: not supported"
                )

    def _init_rotation(self, config) -> None:
        self._kinds = _layer_types(config)
        window = getattr(config, "sliding_window", None)
        self._windows = [
            int(window) if kind == "sliding_attention" and window else None for kind in self._kinds
        ]
        tables = {}
        for kind in sorted(set(self._kinds)):
            inv_freq = getattr(self._rotary, f"{kind}_inv_freq").float().cpu()
            tables[kind] = rope_cos_sin_cache(inv_freq, self._max_positions).to(self.device)
        self._tables = [tables[kind] for kind in self._kinds]
        self.cos_sin_cache = self._tables[0]
        # every window is reproduced per layer: the prompt length is not bounded
        self.max_exact_tokens = None
        self._softcap = getattr(config, "final_logit_softcapping", None)

    def _rope_description(self, config) -> str:
        kinds = "".join("s" if kind == "sliding_attention" else "f" for kind in self._kinds)
        params = sorted((k, sorted(v.items())) for k, v in config.rope_parameters.items())
        window = getattr(config, "sliding_window", None)
        return f"{params},neox={self.is_neox},layers={kinds},window={window}"

    def _cos_sin(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary(x, positions.to(self.device)[None, :], self._kinds[layer])

    def _rotary_kind(self, layer: int) -> object:
        return self._kinds[layer]

    def sliding_window(self, layer: int) -> int | None:
        return self._windows[layer]

    def rotation_table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def attention_output(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        out = block.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        return block.post_attention_layernorm(out)  # before the caller's residual add

    def mlp_block(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        mlp = block.mlp(block.pre_feedforward_layernorm(hidden))
        return hidden + block.post_feedforward_layernorm(mlp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self._decoder.norm(hidden))
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()
