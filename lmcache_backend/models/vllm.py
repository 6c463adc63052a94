"""Model adapter for vLLM's decoder models: Llama, Mistral, Qwen2, Qwen3, Gemma 3.

They share one module layout in vLLM: ``model.model.layers[i].self_attn`` with a fused
``qkv_proj`` (Qwen2: with bias), ``rotary_emb(positions, q, k)``, ``o_proj``, and per layer
``input_layernorm`` / ``post_attention_layernorm`` / ``mlp``; Qwen3 and Gemma 3 add
``q_norm``/``k_norm`` over the head dim before RoPE. Linear layers return ``(output, bias)``.

Gemma 3 (``Gemma3ForCausalLM``) differs in its norms and per layer:

* Gemma's RMSNorm ``x * (1 + weight)`` (vLLM's ``GemmaRMSNorm``), four per layer:
  ``input_layernorm``; ``post_attention_layernorm`` on the attention output *before* the
  residual add; ``pre_feedforward_layernorm`` (the fused add with the residual) and
  ``post_feedforward_layernorm`` around the MLP;
* the embedding scaled by ``sqrt(hidden_size)`` (inside ``embed_input_ids``), softmax scale
  ``query_pre_attn_scalar ** -0.5``, an optional final logit softcap (vLLM's logits processor);
* each layer's own rotary module (local layers RoPE base 10k, global ones 1M with their
  scaling; layers of one kind share a module): one rotation table per distinct module
  (:meth:`VLLMModelAdapter.rotation_table`);
* each layer's sliding window, read from vLLM's attention layer (``sliding_window``)
  (:meth:`VLLMModelAdapter.sliding_window`). Every architecture's windows are read so.

vLLM's decoder layers carry the residual separately and use fused add+RMSNorm:
``norm(x, residual)`` adds in fp32, keeps the sum rounded to the model dtype as the next residual,
but normalizes the *unrounded* fp32 sum. The adapter reproduces that exactly inside the
blender's one-stream interface (``h = h + attention_output(...)``; ``h = mlp_block(h)``):

* ``attention_output`` returns the o_proj output in fp32, so ``h + o`` is the exact fp32 sum;
* ``mlp_block`` normalizes that fp32 sum, rounds it to the model dtype as the residual, adds the
  MLP output in fp32 and returns the sum rounded to the model dtype (vLLM's next residual),
  remembering the fp32 sum for the next layer's ``attention_input`` (and the final norm).

Normalizing a rounded sum instead was the main source of bf16 drift from vLLM's own prefill.

Tensor parallelism: the attention modules hold this rank's heads (``num_heads``/``num_kv_heads``
below are per rank); ``o_proj`` and the MLP's ``down_proj`` all-reduce, so every rank ends each
layer with the full hidden state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch

from lmcache_backend.compat.gate import current_profile
from lmcache_backend.models.base import (
    ModelAdapter,
    UnsupportedModelError,
    pure_rotation_table,
    sliding_window_span,
)
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.models.vllm_layers import (
    GEMMA_NORMS,
    attention_window,
    check_layers,
    check_rotary,
    cpu_rotary_op,
    native_rotary,
)

logger = logging.getLogger(__name__)

#: vLLM architectures the adapter knows (``hf_config.architectures[0]``).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)

#: vLLM implementations that ignore a config's ``head_dim`` (hidden_size / num_heads instead).
_HEAD_DIM_FROM_HIDDEN_SIZE = ("Qwen2ForCausalLM",)


def _weight_files_digest(model_path: str) -> str:
    """Names, sizes and modification times of a local model folder's weight files."""
    h = hashlib.sha256()
    if os.path.isdir(model_path):
        for name in sorted(os.listdir(model_path)):
            if name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
                st = os.stat(os.path.join(model_path, name))
                h.update(f"{name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def vllm_fingerprint(vllm_config: Any) -> ModelFingerprint:
    """The model fingerprint of one tensor-parallel rank, from vLLM's configuration alone.

    The scheduler process never holds the weights but must compute the same segment keys as the
    worker, so the fingerprint comes from the config: architecture, geometry, RoPE settings,
    dtype and a digest of the model's identity (name, revision, quantization and, for a local
    folder, its weight files' names/sizes/times), so two fine-tunes do not share entries.
    """
    mc = vllm_config.model_config
    hf = mc.hf_text_config if hasattr(mc, "hf_text_config") else mc.hf_config
    num_heads = int(hf.num_attention_heads)
    num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or num_heads)
    architectures = getattr(mc.hf_config, "architectures", None) or ["unknown"]
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
    if architectures[0] in _HEAD_DIM_FROM_HIDDEN_SIZE:
        head_dim = int(hf.hidden_size // num_heads)
    rope = {
        "rope_theta": getattr(hf, "rope_theta", None),
        "rope_scaling": getattr(hf, "rope_scaling", None),
        "rope_parameters": getattr(hf, "rope_parameters", None),
    }
    if getattr(hf, "layer_types", None):  # layers that differ (Gemma 3): their kinds and window
        rope["layer_types"] = list(hf.layer_types)
        rope["sliding_window"] = getattr(hf, "sliding_window", None)
    identity = {
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "quantization": getattr(mc, "quantization", None),
        "files": _weight_files_digest(str(mc.model)),
    }
    # A tensor-parallel rank holds (and stores) only its share of the heads.
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return ModelFingerprint(
        architecture=str(architectures[0]),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads // tp,
        num_kv_heads=max(1, num_kv_heads // tp),
        head_dim=head_dim,
        rope=json.dumps(rope, sort_keys=True, default=str) + ",neox=True",
        dtype=str(mc.dtype),
        weights_digest=hashlib.sha256(
            json.dumps(identity, sort_keys=True, default=str).encode()
        ).hexdigest()[:16],
    )


def rms_norm(norm: torch.nn.Module, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's RMSNorm module ``norm`` over ``hidden [N, hidden]`` -> ``[N, hidden]`` in ``dtype``.

    The RMSNorm computes in fp32 and multiplies by the weight in its dtype, so an fp32 input (the
    unrounded residual stream) gives the fused op's output in fp32 storage. Off the CPU that
    input goes through the op's PyTorch path (``forward_native``): vLLM's fused CUDA kernel reads
    the weight in the input's dtype (vLLM 0.9-0.11 in eager mode), a bf16 weight as fp32 bits.
    """
    if hidden.dtype != dtype and hidden.device.type != "cpu":
        return norm.forward_native(hidden).to(dtype)
    return norm(hidden).to(dtype)


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """vLLM's linear layers return ``(output, output_bias)``; plain ``nn.Linear`` a tensor."""
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


class VLLMModelAdapter(ModelAdapter):
    """Adapter over a loaded vLLM ``*ForCausalLM`` (Llama, Mistral, Qwen2, Qwen3, Gemma 3).

    Args:
        model: the runner's model (not a CUDA-graph wrapper).
        vllm_config: the engine's ``VllmConfig`` (for the fingerprint and the sliding window).

    Raises:
        UnsupportedModelError: (a ``ValueError``) unsupported architecture (the message lists
            the supported ones), or a layer kind of it the adapter cannot reproduce; one line.
        ValueError: a model split across pipeline stages.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{arch} is not supported by the CacheBlend vLLM adapter "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self.model = model
        self._decoder = model.model
        self._layers = model.model.layers
        start = getattr(self._decoder, "start_layer", 0)
        end = getattr(self._decoder, "end_layer", len(self._layers))
        if start != 0 or end != len(self._layers):
            raise ValueError("CacheBlend needs every layer in one process (no pipeline split)")
        self._profile = current_profile()
        attn = self._layers[0].self_attn
        self.num_layers = len(self._layers)
        self.num_heads = int(attn.num_heads)  # this rank's heads
        self.num_kv_heads = int(attn.num_kv_heads)
        self.head_dim = int(attn.head_dim)
        self._q_size = self.num_heads * self.head_dim
        self._kv_size = self.num_kv_heads * self.head_dim
        self.attn_scale = float(self._profile.softmax_scale(attn))
        mc = vllm_config.model_config
        hf = mc.hf_text_config if hasattr(mc, "hf_text_config") else mc.hf_config
        check_layers(arch, self._layers, hf)
        self._gemma_norms = arch in GEMMA_NORMS
        # one rotation table per distinct rotary module (Gemma 3: local and global layers)
        rotaries = [layer.self_attn.rotary_emb for layer in self._layers]
        tables: dict[int, torch.Tensor] = {}
        for layer, rotary in zip(self._layers, rotaries):
            if id(rotary) not in tables:
                check_rotary(arch, layer.self_attn, rotary)
                # fp32, recomputed rather than read from the buffer (which vLLM casts to the
                # model dtype on first use), and normalized to a pure rotation: YaRN-style
                # tables carry an attention factor that re-rotation must not apply twice.
                table = pure_rotation_table(rotary._compute_cos_sin_cache()).to(self.device)
                tables[id(rotary)] = table
        if len({bool(r.is_neox_style) for r in rotaries}) != 1:
            raise UnsupportedModelError(
                f"CacheBlend cannot re-rotate cached keys of this {arch}: its layers pair RoPE "
                "features differently; serve it without the CacheBlend connector"
            )
        self.is_neox = bool(rotaries[0].is_neox_style)
        self._tables = [tables[id(r)] for r in rotaries]
        self.cos_sin_cache = self._tables[0]
        # angle-difference tables of rope_rerotate_k, per (table, dtype)
        self._delta_caches: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # each layer's window as vLLM's attention applies it; the blender reproduces each. A
        # release whose attention layer does not say: the config's window bounds the prompts
        # blended (longer ones fall back to a full prefill)
        if all(hasattr(layer.self_attn.attn, "sliding_window") for layer in self._layers):
            self._windows = [attention_window(layer) for layer in self._layers]
            self.max_exact_tokens = None
        else:
            self._windows = [None] * self.num_layers
            self.max_exact_tokens = sliding_window_span(hf)
        self._fingerprint = vllm_fingerprint(vllm_config)
        if self._fingerprint.head_dim != self.head_dim:
            raise ValueError(
                f"CacheBlend cannot serve this {arch}: its attention uses head_dim "
                f"{self.head_dim}, its config says {self._fingerprint.head_dim}"
            )
        self._embed = self._profile.embedding_accessor(model)
        # On CPU, RoPE through vLLM's fused C++ op instead of the module's eager PyTorch code,
        # which vLLM itself only runs compiled: one kernel instead of ~20 small ops (0.1-0.6 ms
        # a layer here), and its fp32 math rounded once equals the compiled graph's, where
        # the eager code rounds after every bf16 op.
        cpu = self.device.type == "cpu" and all(native_rotary(r) for r in rotaries)
        self._rope_op = cpu_rotary_op() if cpu else None
        self._rope_tables: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # (stream returned by mlp_block, its unrounded fp32 sum): see the module docstring
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def sliding_window(self, layer: int) -> int | None:
        return self._windows[layer]

    def rotation_table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

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
        return self._embed(token_ids.to(self.device))

    def _unrounded(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fp32 sum ``hidden`` was rounded from, when ``hidden`` is (a tail of) the stream
        the last ``mlp_block`` returned; else ``hidden`` itself."""
        pending = self._pending
        if pending is None or hidden.dtype != self.dtype:
            return hidden
        stream, exact = pending
        n = hidden.shape[0]
        if (
            hidden.untyped_storage().data_ptr() == stream.untyped_storage().data_ptr()
            and n <= stream.shape[0]
            and hidden.data_ptr() == stream[stream.shape[0] - n :].data_ptr()
        ):
            return exact[exact.shape[0] - n :]
        return hidden

    def _norm(self, norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(norm, hidden, self.dtype)

    def attention_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._norm(self._layers[layer].input_layernorm, self._unrounded(hidden))

    def qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self._layers[layer].self_attn
        n = x.shape[0]
        qkv = _linear(attn.qkv_proj, x)
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: RMSNorm over each head, before RoPE
            q = attn.q_norm(q.reshape(n, self.num_heads, self.head_dim)).reshape(n, -1)
            k = attn.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, -1)
        # vLLM's rotary op works in place on contiguous [N, H*D] rows
        q, k = q.contiguous(), k.contiguous()
        if self._rope_op is not None:
            table = self._rope_table(attn.rotary_emb, q.dtype)
            self._rope_op.rotary_embedding(
                positions.to(self.device), q, k, self.head_dim, table, self.is_neox
            )
        else:
            q, k = attn.rotary_emb(positions.to(self.device), q, k)
        return (
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.reshape(n, self.num_kv_heads, self.head_dim),
        )

    def rope_rerotate_k(
        self,
        k: torch.Tensor,
        old_positions: torch.Tensor,
        new_positions: torch.Tensor,
        table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """In place: keys ``[T, H, D]`` (any number of heads, e.g. layers x heads) rotated at
        ``old_positions`` moved to ``new_positions`` with ``table`` (one of
        :meth:`rotation_groups`' tables; default the first layer's), through vLLM's own rotary
        op on CPU.

        Moving by ``new - old`` is RoPE at position ``new - old``; the op indexes a table of
        angle differences ``-(P-1)..P-1`` (``sin`` negated for negative ones) in the model dtype,
        as vLLM's forward RoPE does. About 100x faster than the fp32 torch reference here (2.5 ms
        against 200+ ms for 1,000 tokens x 30 layers); results agree within one bf16 rounding.
        Falls back to the reference off CPU or for other layouts.
        """
        from lmcache_backend.ops.reference import rope_rerotate_k

        table = self.cos_sin_cache if table is None else table
        ops = cpu_rotary_op()
        if ops is None or k.device.type != "cpu" or not k.is_contiguous() or k.dim() != 3:
            return rope_rerotate_k(k, old_positions, new_positions, table, self.is_neox)
        key = (id(table), k.dtype)
        deltas = self._delta_caches.get(key)
        if deltas is None:
            half = table.shape[-1] // 2
            past = table[1:].flip(0)
            negative = torch.cat([past[:, :half], -past[:, half:]], dim=-1)
            deltas = self._delta_caches[key] = torch.cat([negative, table]).to(k.dtype).contiguous()
        offset = table.shape[0] - 1
        delta = (new_positions.long() - old_positions.long() + offset).to(k.device)
        ops.rotary_embedding(delta, k.view(k.shape[0], -1), None, k.shape[-1], deltas, self.is_neox)
        return k

    def _rope_table(self, rotary: Any, dtype: torch.dtype) -> torch.Tensor:
        """The module's ``cos_sin_cache`` in ``dtype``, as its forward casts it."""
        key = (id(rotary), dtype)  # layers usually share one module
        table = self._rope_tables.get(key)
        if table is None:
            table = rotary.cos_sin_cache.to(self.device, dtype).contiguous()
            self._rope_tables[key] = table
        return table

    def attention_output(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        out = _linear(block.self_attn.o_proj, attn.reshape(attn.shape[0], -1).to(self.dtype))
        if self._gemma_norms:  # normed before the residual add, rounded as vLLM's output is
            out = self._norm(block.post_attention_layernorm, out)
        return out.float()

    def mlp_block(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        block = self._layers[layer]
        exact = self._unrounded(hidden).float()
        residual = exact.to(self.dtype)
        if self._gemma_norms:
            out = block.mlp(self._norm(block.pre_feedforward_layernorm, exact))
            out = self._norm(block.post_feedforward_layernorm, out)
        else:
            out = block.mlp(self._norm(block.post_attention_layernorm, exact))
        total = residual.float() + out.float()
        stream = total.to(self.dtype)
        self._pending = (stream, total)
        return stream

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self._norm(self._decoder.norm, self._unrounded(hidden))
        self._pending = None
        out = self._profile.compute_logits(self.model, normed)
        if out is None:  # tensor-parallel ranks other than the first receive no gathered logits
            vocab = self.model.lm_head.org_vocab_size
            return torch.zeros(hidden.shape[0], vocab, device=hidden.device)
        return out.float()
