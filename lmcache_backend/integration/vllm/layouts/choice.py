"""Which layout serves the cache vLLM handed over, recognised from the object itself.

The forms recorded from the released packages (``tests/fixtures/engine_contracts``; ``H`` KV
heads, ``D`` head dim, ``NB``/``BS`` blocks and tokens per block as the cache counts them):

* ``[2, NB, BS, H, D]``: FLASH_ATTN 0.9.2-0.22.1, TRITON_ATTN 0.9.2-0.10.2 (NHD or HND).
* ``[NB, 2, BS, H, D]``: FLASHINFER 0.9.2-0.25.1, TRITON_ATTN 0.11.0-0.25.1, FLASH_ATTN
  0.23.0-0.25.1 (NHD or HND).
* ``[NB, H, BS, 2*D]``: FLASH_ATTN, FLASHINFER, TRITON_ATTN from 0.26.0 (NHD or HND; from 0.29
  the ``KVCacheLayout`` orders LBNHC/BLNHC, LBHNC/BLHNC/BHLNC, LHBNC); from 0.30 also the
  composite backends TRITON_FLASH_ATTN (SM90) and TRITON_FLASHINFER (SM100), which vLLM picks
  for models with bidirectional image prefixes (``model_type`` gemma3, paligemma, ...): Triton
  and FlashAttention / FlashInfer over one shared cache, each reading it as alone.
* a ``[k, v]`` list (vllm-ascend 0.9) or ``(k, v)`` tuple (0.11-0.23), each a contiguous
  ``[NB, BS, H, D]``: backend ASCEND, or CUSTOM / FLASH_ATTN (0.23, V1 / V2 model runner).

The memory order comes from the strides: NHD keeps a token's heads together (``[NB, BS, H, D]``
in memory), HND a head's tokens (``[NB, H, BS, D]``). The backend's name, where given, must be
one that handed the form over. vLLM 0.9.2-0.10.2's TRITON_ATTN under
``VLLM_V1_USE_PREFILL_DECODE_ATTENTION=1`` reads its ``[2, NB, BS, H, D]`` cache in another
element order (``PagedAttention.split_kv_cache``: K ``[NB, H, D/x, BS, x]``, V ``[NB, H, D, BS]``)
and is refused naming the variable. Anything else -- another rank, a pair that is not two equal
tensors (MLA, sparse-attention indexer caches), quantized caches (fp8, int8, nvfp4, per-token-head
scales), the FRACTAL_NZ cache of 310P cards, an unrecorded memory order, vLLM's CPU backend
(served by :class:`~.cpu.CpuLayout`) -- is refused with one line naming what was handed over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_backend.compat.vllm import FIVE_D_CUDA_CACHES, PACKED_CUDA_CACHES_FROM
from lmcache_backend.integration.vllm.layouts.base import LayerCache
from lmcache_backend.integration.vllm.layouts.device import (
    BLOCK_FIRST,
    KV_FIRST,
    PACKED,
    PAIR,
    CacheForm,
    DeviceLayout,
)
from lmcache_backend.ops import Ops
from lmcache_backend.settings.environment import read_variable

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_BACKENDS = frozenset({"CPU_ATTN", "TORCH_SDPA"})


@dataclass(frozen=True)
class _Recorded:
    """Where a form was recorded: by which backends, in which memory orders.

    Attributes:
        orders: stride order (logical dims, outermost first) -> its name.
    """

    form: CacheForm
    backends: frozenset[str]
    orders: dict[tuple[int, ...], str]


_FIVE_D_ORDERS = {(0, 1, 2, 3, 4): "NHD", (0, 1, 3, 2, 4): "HND"}
_RECORDED = {
    KV_FIRST.name: _Recorded(KV_FIRST, frozenset({"FLASH_ATTN", "TRITON_ATTN"}), _FIVE_D_ORDERS),
    BLOCK_FIRST.name: _Recorded(
        BLOCK_FIRST, frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"}), _FIVE_D_ORDERS
    ),
    PACKED.name: _Recorded(
        PACKED,
        # TRITON_FLASH_ATTN / TRITON_FLASHINFER (0.30+): composites of TRITON_ATTN and
        # FLASH_ATTN / FLASHINFER sharing one cache, which both children read as alone
        frozenset(
            {"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "TRITON_FLASH_ATTN", "TRITON_FLASHINFER"}
        ),
        {(0, 2, 1, 3): "NHD (LBNHC)", (0, 1, 2, 3): "HND (LBHNC)", (1, 0, 2, 3): "LHBNC"},
    ),
    # vllm-ascend 0.23 names its backend CUSTOM, or FLASH_ATTN under the V2 model runner.
    PAIR.name: _Recorded(PAIR, frozenset({"ASCEND", "CUSTOM", "FLASH_ATTN"}), {(0, 1, 2, 3): "ND"}),
}
_KNOWN_BACKENDS = frozenset().union(*(r.backends for r in _RECORDED.values()))

#: (form, backend) -> (vLLM environment variable, how the backend then reads the form): a set
#: variable makes the backend read the form in another element order than the form's views (a
#: backend not named might be that one). vLLM 0.9.2-0.10.2 TRITON_ATTN: its prefill/decode
#: kernels instead of the unified one, through ``PagedAttention.split_kv_cache``
#: (``x = 16 // element size``).
_ELEMENT_ORDER_SWITCHES = {
    (KV_FIRST.name, "TRITON_ATTN"): (
        "VLLM_V1_USE_PREFILL_DECODE_ATTENTION",
        "K [NB, H, D/x, BS, x] and V [NB, H, D, BS] (PagedAttention.split_kv_cache)",
    )
}

SUPPORTED = (
    f"[2, NB, BS, H, D] / [NB, 2, BS, H, D] (NHD or HND; vLLM {'-'.join(FIVE_D_CUDA_CACHES)}), "
    f"[NB, H, BS, 2*D] (NHD/LBNHC, HND/LBHNC, LHBNC; vLLM {PACKED_CUDA_CACHES_FROM}+), "
    "a (k, v) tuple or [k, v] list of contiguous [NB, BS, H, D] (vllm-ascend), "
    "fp32/fp16/bf16, backends FLASH_ATTN, FLASHINFER, TRITON_ATTN, TRITON_FLASH_ATTN, "
    "TRITON_FLASHINFER, ASCEND/CUSTOM"
)


class UnsupportedKVCache(ValueError):
    """The cache handed over is not a recorded form; the message is one line."""


def normalize_backend_name(name: str | None) -> str | None:
    """``FLASH_ATTN_VLLM_V1`` (vLLM 0.9-0.10) -> ``FLASH_ATTN``; ``None`` stays ``None``."""
    if name is None:
        return None
    return str(name).strip().upper().removesuffix("_VLLM_V1") or None


def backend_name_of(layer: Any) -> str | None:
    """The attention backend's ``get_name()`` of a vLLM attention layer, or ``None``."""
    backend = getattr(layer, "attn_backend", None)
    if backend is None and callable(getattr(layer, "get_attn_backend", None)):
        backend = layer.get_attn_backend()
    get_name = getattr(backend, "get_name", None)
    if get_name is None:
        return None
    try:
        return str(get_name())
    except Exception:  # a backend whose name needs state we do not have: go by the cache alone
        return None


def _describe(cache: Any) -> str:
    if isinstance(cache, torch.Tensor):
        return f"shape {tuple(cache.shape)} strides {cache.stride()} dtype {cache.dtype}"
    if isinstance(cache, (tuple, list)):
        parts = "; ".join(_describe(t) for t in cache)
        return f"{type(cache).__name__} of {len(cache)} [{parts}]"
    return type(cache).__name__


def _refuse(reason: str, cache: Any, backend: str | None) -> UnsupportedKVCache:
    return UnsupportedKVCache(
        f"CacheBlend cannot use this KV cache: {reason}; got {_describe(cache)}, "
        f"backend {backend or 'not named'}; supported: {SUPPORTED}"
    )


def env_flag(name: str) -> str | None:
    """The value of vLLM's boolean environment variable ``name`` when it is on, read as
    ``vllm/envs.py`` reads it (``"true"`` or ``"1"``, any case); ``None`` when off or unset."""
    value = read_variable(name)
    return value if value is not None and value.lower() in ("true", "1") else None


def _element_order_switch(form: CacheForm, backend: str | None) -> str | None:
    """Why ``backend`` reads ``form`` in another element order than its views, when a vLLM
    variable that makes it so is set; ``None`` otherwise."""
    for (form_name, switched), (variable, how) in _ELEMENT_ORDER_SWITCHES.items():
        value = env_flag(variable)
        if form.name == form_name and backend in (switched, None) and value is not None:
            return (
                f"{variable}={value} makes vLLM's {switched} read this cache as {how}, an element "
                f"order CacheBlend does not write; unset {variable} or use another attention "
                f"backend"
            )
    return None


def _follows(t: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether ``t``'s memory nests its dims in ``order`` (outermost first), innermost dense.

    Gaps between blocks are allowed (0.29+ views whose block stride spans other layers);
    dims of size 1 have no order.
    """
    dims = [d for d in order if t.shape[d] > 1]
    if not dims or t.stride(dims[-1]) != 1:
        return False
    return all(
        t.stride(outer) >= t.stride(inner) * t.shape[inner] for outer, inner in zip(dims, dims[1:])
    )


def _tensor_form(cache: torch.Tensor, heads: int, head_dim: int, refuse) -> CacheForm:
    if cache.dim() == 5:
        if tuple(cache.shape[3:]) != (heads, head_dim):
            raise refuse(f"a 5-D cache must end in [BS, {heads}, {head_dim}] (KV heads, head dim)")
        kv0, kv1 = cache.shape[0] == 2, cache.shape[1] == 2
        if kv0 and kv1:
            raise refuse("2 blocks: [2, NB, ...] and [NB, 2, ...] cannot be told apart")
        if not (kv0 or kv1):
            raise refuse("a 5-D cache needs its K/V axis of size 2 first or second")
        return KV_FIRST if kv0 else BLOCK_FIRST
    if cache.dim() == 4:
        if cache.shape[1] != heads or cache.shape[3] != 2 * head_dim:
            raise refuse(f"a 4-D cache must be [NB, {heads}, BS, {2 * head_dim}]")
        return PACKED
    raise refuse(f"a {cache.dim()}-D tensor is no recorded cache form")


def _pair_form(cache: tuple | list, heads: int, head_dim: int, refuse) -> CacheForm:
    if len(cache) != 2:
        raise refuse(f"{len(cache)} caches per layer, not a K/V pair (MLA or sparse-attention)")
    k, v = cache
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise refuse("K and V caches differ in shape, dtype or device (MLA nope/rope caches?)")
    if k.dim() == 4 and k.shape[3] == 16 and k.shape[1] * 16 == heads * head_dim:
        raise refuse("FRACTAL_NZ cache [NB, H*D/16, BS, 16] of Atlas 300I (310P) cards")
    if k.dim() != 4 or tuple(k.shape[2:]) != (heads, head_dim):
        raise refuse(f"K and V caches must each be [NB, BS, {heads}, {head_dim}]")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise refuse("K and V caches must be contiguous (ND), as vllm-ascend allocates them")
    return PAIR


def layout_for(
    cache: LayerCache,
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    backend_name: str | None = None,
    ops: Ops,
) -> DeviceLayout:
    """The layout that writes and reads tokens where the backend reads them.

    Args:
        cache: one layer's cache as ``register_kv_caches`` received it.
        num_kv_heads, head_dim: this rank's ``H`` and ``D``.
        block_size: the scheduler's block size (``vllm_config.cache_config.block_size``).
        backend_name: the attention backend's ``get_name()`` (:func:`backend_name_of`), if known.
        ops: the op registry that moves the rows.

    Raises:
        UnsupportedKVCache: a ``ValueError`` with one line naming the shape, strides, dtype and
            backend, and the supported forms.
    """
    backend = normalize_backend_name(backend_name)

    def refuse(reason: str) -> UnsupportedKVCache:
        return _refuse(reason, cache, backend)

    if backend in _CPU_BACKENDS:
        raise refuse("vLLM's CPU backend caches are read through CpuLayout, not here")
    if backend is not None and backend not in _KNOWN_BACKENDS:
        raise refuse(f"attention backend {backend} has no recorded cache layout")
    if isinstance(cache, (tuple, list)):
        tensors = list(cache)
    elif isinstance(cache, torch.Tensor):
        tensors = [cache]
    else:
        raise refuse("neither a tensor nor a (k, v) pair")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise refuse("the pair holds something other than tensors")
    bad = [t.dtype for t in tensors if t.dtype not in _FLOAT_DTYPES]
    if bad:
        raise refuse(f"{bad[0]} is a quantized cache (CacheBlend needs fp32/fp16/bf16 K/V)")
    if isinstance(cache, torch.Tensor):
        form = _tensor_form(cache, num_kv_heads, head_dim, refuse)
    else:
        form = _pair_form(tensors, num_kv_heads, head_dim, refuse)
    recorded = _RECORDED[form.name]
    if backend is not None and backend not in recorded.backends:
        raise refuse(f"{backend} never handed over a {form.shape} cache")
    switched = _element_order_switch(form, backend)
    if switched is not None:
        raise refuse(switched)
    checked = tensors[0] if form is PAIR else cache
    memory = next((name for o, name in recorded.orders.items() if _follows(checked, o)), None)
    if memory is None:
        raise refuse(f"memory order not one recorded for {form.shape}")
    kernel_block_size = int(form.views(cache, head_dim)[0].shape[1])
    if kernel_block_size < 1 or block_size % kernel_block_size:
        raise refuse(
            f"the cache's blocks of {kernel_block_size} tokens do not divide the scheduler's "
            f"blocks of {block_size}"
        )
    layout = DeviceLayout(form, head_dim, block_size, kernel_block_size, ops, memory, backend)
    logger.info("CacheBlend KV cache layout: %s", layout.describe())
    return layout
