"""Model adapter for HF transformers decoder models: Llama, Mistral, Qwen2, Qwen3, Gemma 3.

Llama, Mistral, Qwen2 and Qwen3 share one layout
(``model.model.layers[i].self_attn.{q,k,v,o}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``mlp``, NeoX-style RoPE from ``model.model.rotary_emb``); Qwen3
adds ``q_norm``/``k_norm`` over the head dim before RoPE, Qwen2 adds q/k/v biases (inside the
Linear). A family with a layer of its own has a subclass in its own module
(:mod:`lmcache_backend.models.gemma3`), which ``HFModelAdapter(model)`` returns for it.
"""

from __future__ import annotations

import hashlib
import importlib
import logging

import torch

from lmcache_backend.models.base import (
    ModelAdapter,
    UnsupportedModelError,
    rope_cos_sin_cache,
    sliding_window_span,
)
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.ops.memo import TensorMemo

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")

#: model type -> (module, class) of the adapter subclass for a family with its own layer maths
FAMILY_ADAPTERS = {"gemma3_text": ("lmcache_backend.models.gemma3", "Gemma3Adapter")}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def weights_digest(tensors: list[torch.Tensor]) -> str:
    """A short hash of a few weight rows: tells fine-tunes of one architecture apart cheaply."""
    h = hashlib.sha256()
    for t in tensors:
        rows = t.detach().reshape(t.shape[0], -1)[:4].float().cpu().contiguous()
        h.update(rows.numpy().tobytes())
    return h.hexdigest()[:16]


class HFModelAdapter(ModelAdapter):
    """Adapter over a ``transformers`` ``*ForCausalLM`` of a supported type.

    Raises:
        UnsupportedModelError: (a ``ValueError``) the model type, or a layer kind or setting of
            it, is not supported; one line naming it.
    """

    def __new__(cls, model: torch.nn.Module) -> HFModelAdapter:
        family = FAMILY_ADAPTERS.get(getattr(model.config, "model_type", None))
        if cls is HFModelAdapter and family is not None:
            cls = getattr(importlib.import_module(family[0]), family[1])
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the HF adapter "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self._check_config(config)
        self.model = model
        self._decoder = model.model
        self._layers = model.model.layers
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.attn_scale = float(self._layers[0].self_attn.scaling)
        self.is_neox = True  # HF's rotate_half pairs feature i with i + D/2
        self._rotary = self._decoder.rotary_emb
        self._max_positions = int(getattr(config, "max_position_embeddings", 32768))
        # each pass's cos/sin at its rows' positions, computed in its first layer: the layers
        # of a pass (and of one rotary kind) turn the same positions by the same angles
        self._angles: TensorMemo[tuple[torch.Tensor, torch.Tensor]] = TensorMemo(size=4)
        self._init_rotation(config)
        self._model_type = model_type
        self._fingerprint = ModelFingerprint(
            architecture=type(model).__name__,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope=self._rope_description(config),
            dtype=str(self.dtype),
            weights_digest=weights_digest(
                [self._decoder.embed_tokens.weight, self._layers[-1].self_attn.k_proj.weight]
            ),
        )

    def _check_config(self, config) -> None:
        """Raise :class:`UnsupportedModelError` for a setting of ``config`` the adapter cannot
        reproduce exactly (the family adapters check their own)."""

    def _init_rotation(self, config) -> None:
        """``cos_sin_cache`` (one table for every layer) and ``max_exact_tokens``."""
        if getattr(self._rotary, "rope_type", "default") == "dynamic":
            raise UnsupportedModelError(
                f"model_type {config.model_type!r}: dynamic RoPE scaling changes frequencies "
                "with length: not supported"
            )
        inv_freq = self._rotary.inv_freq.float().cpu()
        self.cos_sin_cache = rope_cos_sin_cache(inv_freq, self._max_positions).to(self.device)
        self.max_exact_tokens = sliding_window_span(config)

    def _rope_description(self, config) -> str:
        rope_params = getattr(config, "rope_parameters", None) or {
            "rope_theta": getattr(config, "rope_theta", None),
            "rope_scaling": getattr(config, "rope_scaling", None),
        }
        return f"{sorted(rope_params.items())},neox={self.is_neox}"

    def _cos_sin(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's rotary module at ``positions [N]``: ``cos, sin [1, N, D]``."""
        return self._rotary(x, positions.to(self.device)[None, :])

    def _rotary_kind(self, layer: int) -> object:
        """Which of the model's rotations ``layer`` applies (one for every layer here)."""
        return None

    def _angles_at(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [N, 1, D]`` of :meth:`_cos_sin`, once per ``positions`` tensor, rotary
        kind and dtype (HF's module casts them to ``x``'s dtype)."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = self._cos_sin(layer, x, positions)
            return cos[0, :, None, :], sin[0, :, None, :]

        key = (positions, self._rotary_kind(layer), x.dtype, x.device)
        return self._angles.get(key, build)

    @property
    def device(self) -> torch.device:
        return self._decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._decoder.embed_tokens.weight.dtype

    @property
    def fingerprint(self) -> ModelFingerprint:
        return self._fingerprint

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._decoder.embed_tokens(token_ids.to(self.device))

    def attention_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._layers[layer].input_layernorm(hidden)

    def qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self._layers[layer].self_attn
        n = x.shape[0]
        q = attn.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: RMSNorm over the head dim, before RoPE
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        # HF's own rotary module and formula, so results match the model's forward bit for bit.
        cos, sin = self._angles_at(layer, x, positions)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def attention_output(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        return self._layers[layer].self_attn.o_proj(attn.reshape(attn.shape[0], -1))

    def mlp_block(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._decoder.norm(hidden)).float()
