"""The model-adapter interface: the per-layer primitives the blender needs.

The blender never imports a model library; an adapter (HF transformers here, vLLM in the vLLM
integration) exposes one decoder layer as four steps, for any subset of tokens:

    x = attention_input(layer, h)                 # input norm
    q, k, v = qkv(layer, x, positions)            # projections, q/k norm, RoPE at ``positions``
    h = h + attention_output(layer, attn)         # o_proj and the residual
    h = mlp_block(layer, h)                       # post-attention norm, MLP, residual

Shapes: ``N`` tokens being computed, ``Hq``/``Hkv`` query/key-value heads, ``D`` head dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from lmcache_backend.models.fingerprint import ModelFingerprint


class UnsupportedModelError(ValueError):
    """A model the blender cannot reproduce exactly; the message is one line naming the model
    type and what is missing (the command line prints it as it is)."""


class ModelAdapter(ABC):
    """One loaded decoder-only model seen layer by layer.

    Attributes:
        num_layers, num_heads, num_kv_heads, head_dim: the attention geometry.
        attn_scale: softmax scale of the attention.
        cos_sin_cache: ``[max_pos, R]`` fp32 rotation table (``R/2`` cosines, then ``R/2`` sines,
            without any attention scaling) used to re-rotate cached keys; a model whose layers
            rotate differently (Gemma 3: local and global RoPE bases) gives each layer's table
            through :meth:`rotation_table`, and this is layer 0's.
        is_neox: RoPE pairing (True: split halves, False: interleaved).
        max_exact_tokens: longest prompt the blender's full attention reproduces exactly
            (a sliding window the adapter does not report per layer, shorter than the prompt,
            would make it differ), or None.
        rope_rerotate_k: the engine's own re-rotation kernel, with the signature
            ``(k [N, H, D], old_positions [N], new_positions [N], table=None)`` (in place; a
            ``table`` of :meth:`rotation_groups`, default :attr:`cos_sin_cache`), or None: the
            op registry's ``rope_rerotate_k`` turns the keys.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_scale: float
    is_neox: bool
    cos_sin_cache: torch.Tensor
    max_exact_tokens: int | None = None
    rope_rerotate_k: Callable[..., torch.Tensor] | None = None

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def fingerprint(self) -> ModelFingerprint: ...

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> hidden states ``[T, hidden]``."""

    @abstractmethod
    def attention_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Input norm of ``layer``: ``[N, hidden] -> [N, hidden]``."""

    @abstractmethod
    def qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, hidden]``, ``positions [N]`` -> ``q [N, Hq, D]``, ``k, v [N, Hkv, D]``, with
        any q/k norm and RoPE at ``positions`` applied."""

    @abstractmethod
    def attention_output(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        """Output projection ``[N, Hq, D] -> [N, hidden]``; the caller adds the residual."""

    @abstractmethod
    def mlp_block(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + mlp(post_attention_norm(hidden))``: ``[N, hidden] -> [N, hidden]``."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[N, hidden] -> [N, vocab]`` (fp32)."""

    def sliding_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention: a query at position ``p`` sees keys
        ``p - window + 1 .. p`` (``window`` keys, itself included); None: keys ``0..p``."""
        return None

    def layer_windows(self) -> list[int | None]:
        """Every layer's :meth:`sliding_window`, in layer order."""
        return [self.sliding_window(layer) for layer in range(self.num_layers)]

    def windowed(self) -> bool:
        """Whether attention is not plain causal attention over the whole prompt: some layer
        has a sliding window, or prompts longer than ``max_exact_tokens`` are not reproduced."""
        return self.max_exact_tokens is not None or any(
            window is not None for window in self.layer_windows()
        )

    def rotation_table(self, layer: int) -> torch.Tensor:
        """``layer``'s rotation table (the layout of ``cos_sin_cache``)."""
        return self.cos_sin_cache

    def rotation_groups(self) -> list[tuple[torch.Tensor, list[int]]]:
        """The distinct rotation tables, each with the layers (ascending) that use it: one
        group holding every layer for a model with one RoPE."""
        groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for layer in range(self.num_layers):
            table = self.rotation_table(layer)
            groups.setdefault(id(table), (table, []))[1].append(layer)
        return list(groups.values())

    def layer_kinds(self) -> list[tuple[str, int]]:
        """One ``(description, layer)`` per distinct attention kind (rotation table and
        window), its first layer: what a check of every kind of layer runs on."""
        kinds: dict[tuple[int, int | None], int] = {}
        for layer in range(self.num_layers):
            kinds.setdefault((id(self.rotation_table(layer)), self.sliding_window(layer)), layer)
        if len(kinds) == 1:
            return [("", 0)]
        out = []
        for (_, window), layer in kinds.items():
            kind = f"window {window}" if window is not None else "global"
            out.append((f"layer {layer}, {kind}", layer))
        return out


def window_kwargs(model: ModelAdapter, layer: int) -> dict[str, int]:
    """``{"window": w}`` for an attention op call of a sliding-window layer, else ``{}`` (so the
    ops of a model without windows are called exactly as before)."""
    window = model.sliding_window(layer)
    return {} if window is None else {"window": window}


def sliding_window_span(config) -> int | None:
    """The sliding window an HF model config applies, or None when attention sees every token.

    Qwen2/Qwen3 keep ``sliding_window`` in the config but switch it on with ``use_sliding_window``.
    """
    window = getattr(config, "sliding_window", None)
    use_window = getattr(config, "use_sliding_window", window is not None)
    return int(window) if (window and use_window) else None


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """vLLM-style ``[max_positions, 2 * len(inv_freq)]`` fp32 table: cosines then sines."""
    positions = torch.arange(max_positions, dtype=torch.float64, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.double()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def pure_rotation_table(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``cos_sin_cache`` (``[max_pos, R]``, cosines then sines) with each (cos, sin) pair scaled
    to unit length, in fp32.

    Some RoPE variants fold an attention factor into the table (YaRN's ``mscale``, DeepSeek's
    ``mscale``/``mscale_all_dim``, long-RoPE's scaling factor): ``cos * m``, ``sin * m``. Keys
    rotated with such a table carry ``m`` once; undoing and redoing the rotation with the same
    table would multiply them by ``m**2``. A unit-length table rotates by the angle difference
    and leaves the factor the cached key already holds untouched.
    """
    table = cos_sin_cache.double()
    half = table.shape[-1] // 2
    cos, sin = table[:, :half], table[:, half:]
    norm = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-30)
    return torch.cat([cos / norm, sin / norm], dim=-1).float()
