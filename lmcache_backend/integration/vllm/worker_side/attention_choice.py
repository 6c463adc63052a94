"""Which kernels the blend's attention runs on inside vLLM, decided once at start-up.

* vLLM's CPU paged attention (:class:`~lmcache_backend.integration.vllm.layouts.CpuAttention`):
  the selected queries attend over the request's blocks, where the blend writes every row. Only
  on vLLM's CPU backend, with the engine's block size.
* the op registry's ``attention_at_positions`` where the backend serves it with a kernel of its
  own (``selected_attention``: ``auto``, ``tiled`` or ``vllm``): on CPU the tiled kernel
  (:mod:`lmcache_backend.backends.cpu.tiled_attention`), which attends over the blend's
  contiguous K/V, reading each key block once per tile of queries.
* vLLM's own forward pass (``engine_forward``): runs a fixed selection's tokens through the
  compiled model over the paged cache.

A model with sliding-window layers (Gemma 3) needs the tiled kernel on CPU, which applies each
layer's window (in the engine forward pass too); without it, and on CUDA and Ascend, it gets
none of the paged kernels and no engine forward pass: the blender attends over its own
contiguous K/V with the op registry's ``attention_at_positions(..., window=w)`` per layer
(Triton applies the window; the NPU kernel declines it and the torch reference serves it).

On CUDA and Ascend (a :class:`~lmcache_backend.integration.vllm.layouts.DeviceLayout`) the
blend streams its layers: one layer's cached K/V at a time, written into the blocks before it is
computed. The selected queries attend

* through the block table with the op registry's ``paged_attention_at_positions`` (the layout's
  :meth:`attention`) where the layer's rows are in the blocks only -- after the preview, the
  default selection, which leaves every layer's cached rows there -- and always with
  ``selected_attention: vllm``;
* over the layer's contiguous rows with the op registry's ``attention_at_positions`` where the
  blend holds them (a check layer's selection, ``kv_deviation``) and ``selected_attention`` is
  ``tiled``, or ``auto`` on CUDA: on an H100 that kernel (TMA loads) took 0.66x (8k keys) and
  0.82x (32k) of the paged kernel's time (``docs/measurements/h100-kernels.md``). Ascend keeps
  the paged kernel under ``auto`` until a measurement there says otherwise.

Both read the same values: the blocks receive exactly these rows. (Gathering the blocks to run
the contiguous kernel after a preview would save 2-10 ms per request at 8k-32k tokens on an
H100, 1-2% of the blend, for a layer's K/V of memory: not done.) vLLM's own forward pass is not
used there: its attention metadata is built by each backend's own builder, which differs per
backend and release (see ``docs/cuda.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmcache_backend.config import ConfigError
from lmcache_backend.integration.vllm.layouts import (
    CpuAttention,
    CpuLayout,
    DeviceLayout,
    PagedLayout,
)
from lmcache_backend.integration.vllm.settings import ConnectorSettings
from lmcache_backend.integration.vllm.worker_side.engine_forward import (
    EngineForward,
    SelectedQueriesAttention,
)
from lmcache_backend.models.vllm import VLLMModelAdapter
from lmcache_backend.ops import Ops

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelectedAttention:
    """The kernels of the blend's attention; None where one does not run here.

    Attributes:
        paged: vLLM's CPU paged attention over the request's blocks.
        tiled: the backend's ``attention_at_positions`` kernel over the blend's contiguous K/V
            (with ``paged`` only).
        engine_forward: vLLM's forward pass of a fixed selection (with ``paged`` only).
        device: CUDA/Ascend: the selected queries attend over the blocks through the layout
            (:meth:`DeviceLayout.attention`), and the blend streams its layers.
    """

    paged: CpuAttention | None = None
    tiled: SelectedQueriesAttention | None = None
    engine_forward: EngineForward | None = None
    device: bool = False

    @property
    def device_contiguous(self) -> bool:
        """CUDA/Ascend: where the blend holds a layer's rows contiguous, the selected queries
        attend over them (the backend's ``attention_at_positions``), not through the block
        table."""
        return self.device and self.tiled is not None

    @property
    def reads_blocks(self) -> bool:
        """Whether the selected queries attend over the request's blocks."""
        return self.paged is not None or self.device


def choose_attention(
    settings: ConnectorSettings,
    vllm_config: VllmConfig,
    layer_names: list[str],
    caches: list[torch.Tensor],
    layout: PagedLayout,
    model: VLLMModelAdapter,
    ops: Ops,
) -> SelectedAttention:
    """The kernels for this engine, per its settings, layout, model and op set.

    Raises:
        ConfigError: ``selected_attention="tiled"`` and the backend has no kernel for these
            queries.
    """
    if isinstance(layout, DeviceLayout):
        if model.windowed():  # sliding windows: the blender's own attention, per layer
            return SelectedAttention()
        tiled = _device_contiguous_attention(settings.selected_attention, model, ops)
        return SelectedAttention(tiled=tiled, device=True)
    paged = _paged_attention(vllm_config, layer_names, caches, layout, model)
    if paged is None:
        return SelectedAttention()
    tiled = _tiled_attention(settings.selected_attention, caches[0].dtype, model, ops)
    if model.windowed() and tiled is None:
        # vLLM's paged kernel takes no per-layer window here: the blender's own attention
        logger.info(
            "CacheBlend: the model has sliding-window layers and the tiled kernel does not run "
            "here; the blend attends with the op registry's attention, layer by layer"
        )
        return SelectedAttention()
    engine_forward = None
    if settings.engine_forward and EngineForward.available():
        windows = [model.sliding_window(layer) for layer in range(len(layer_names))]
        engine_forward = EngineForward(model.model, vllm_config, layer_names, paged, tiled, windows)
    return SelectedAttention(paged, tiled, engine_forward)


def _device_contiguous_attention(
    choice: str, model: VLLMModelAdapter, ops: Ops
) -> SelectedQueriesAttention | None:
    """On CUDA/Ascend, the backend's kernel over the layer's contiguous rows, per
    ``selected_attention``: ``tiled`` wants it (or an error naming why not), ``vllm`` the paged
    kernel, ``auto`` it on CUDA and the paged kernel elsewhere."""
    if choice == "vllm" or (choice == "auto" and ops.name != "cuda"):
        return None
    q = torch.zeros(1, model.num_heads, model.head_dim, dtype=model.dtype, device=model.device)
    kv = torch.zeros(1, model.num_kv_heads, model.head_dim, dtype=model.dtype, device=model.device)
    positions = torch.zeros(1, dtype=torch.int64, device=model.device)
    reason = ops.decline_reason("attention_at_positions", q, kv, kv, positions, 1.0)
    if reason is None:
        logger.info(
            "CacheBlend: selected tokens attend over each layer's contiguous rows (%s kernel)",
            ops.name,
        )
        return ops.attention_at_positions
    if choice == "tiled":
        raise ConfigError(f"selected_attention='tiled': {reason}")
    logger.warning(
        "CacheBlend: selected_attention=auto: %s; attending through the block table", reason
    )
    return None


def _paged_attention(
    vllm_config: VllmConfig,
    layer_names: list[str],
    caches: list[torch.Tensor],
    layout: PagedLayout,
    model: VLLMModelAdapter,
) -> CpuAttention | None:
    """vLLM's CPU paged attention for the blender, where the layout and build allow it."""
    if not isinstance(layout, CpuLayout) or not CpuAttention.available():
        return None
    if int(caches[0].shape[2]) != int(vllm_config.cache_config.block_size):
        return None
    import vllm.envs as envs

    layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
    return CpuAttention(
        str(layer.isa),
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        caches[0].dtype,
        bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
    )


def _tiled_attention(
    choice: str, cache_dtype: torch.dtype, model: VLLMModelAdapter, ops: Ops
) -> SelectedQueriesAttention | None:
    """The backend's kernel for the selected queries, per ``selected_attention``; the one place
    that decides it (its users pass it the blend's K/V, in the model's dtype)."""
    if choice == "vllm":
        return None
    if cache_dtype != torch.bfloat16:
        reason = f"the tiled kernel needs a bf16 KV cache, this one is {cache_dtype}"
    else:
        # one query over one key, shaped and typed as the blend's calls are
        q = torch.zeros(1, model.num_heads, model.head_dim, dtype=model.dtype)
        kv = torch.zeros(1, model.num_kv_heads, model.head_dim, dtype=model.dtype)
        positions = torch.zeros(1, dtype=torch.int64)
        reason = ops.decline_reason("attention_at_positions", q, kv, kv, positions, 1.0)
    if reason is None:
        logger.info("CacheBlend: selected tokens attend with the %s backend's kernel", ops.name)
        return ops.attention_at_positions
    if choice == "tiled":
        raise ConfigError(f"selected_attention='tiled': {reason}")
    logger.warning("CacheBlend: selected_attention=auto: %s; using vLLM's attention", reason)
    return None
