"""RoPE re-rotation of cached keys on Ascend through ``torch_npu.npu_rotary_mul``.

Undoing the rotation at ``old`` and applying it at ``new`` is one rotation by ``new - old``; its
cosine and sine come from the cos/sin table with the angle-difference identities, and
``npu_rotary_mul`` applies it to all heads in one fused call:

    half mode (NeoX):        out = r1 * x + r2 * cat(-x[R/2:], x[:R/2])
    interleave mode (GPT-J): out = r1 * x + r2 * [-x1, x0, -x3, x2, ...]

with ``r1``/``r2`` the per-token cosines/sines spread over the ``R`` rotary features.
"""

from __future__ import annotations

import torch

from lmcache_backend.backends.ascend._npu import npu, on_npu_reason
from lmcache_backend.ops import register

# npu_rotary_mul input/r1/r2 dtypes; the rotation itself runs in fp32 here.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Documented limits of npu_rotary_mul on Atlas A2/A3 (jit_compile=False): D < 896, D even,
# B * N < 1000 in interleave mode (B = 1 here, N = key heads).
_MAX_ROTARY_DIM = 896
_MAX_HEADS = 1000


def _heads_view(k: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """``k`` as ``[T, Hkv, D]`` (a view); the 2-D form is split into heads of ``rot_dim``."""
    return k.view(k.shape[0], -1, rot_dim) if k.dim() == 2 else k


def rope_rerotate_k(
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """In place: move RoPE-encoded keys from ``old_positions`` to ``new_positions``.

    Args:
        k: ``[T, Hkv*D]`` or ``[T, Hkv, D]`` fp32/fp16/bf16 keys rotated at ``old_positions``.
            The 2-D form needs ``D == R``; pass the 3-D view when the rotary dim is partial.
        old_positions, new_positions: ``[T]`` integer positions (any device).
        cos_sin_cache: ``[max_pos, R]`` vLLM table, ``R/2`` cosines then ``R/2`` sines.
        is_neox: NeoX (split halves) pairing when True, GPT-J (interleaved) when False.

    Returns:
        ``k``, rotated in place (fp32 math, stored back in ``k.dtype``); features past ``R``
        are untouched.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return k
    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    k3 = _heads_view(k, rot_dim)
    table = cos_sin_cache.to(device=k.device)
    old = table.index_select(0, old_positions.to(device=k.device, dtype=torch.int64)).float()
    new = table.index_select(0, new_positions.to(device=k.device, dtype=torch.int64)).float()
    cos_o, sin_o = old[:, :half], old[:, half:]
    cos_n, sin_n = new[:, :half], new[:, half:]
    # cos/sin of (new - old); clamped because npu_rotary_mul documents r1, r2 in [-1, 1] and the
    # identities can land one rounding step outside.
    cos_d = (cos_n * cos_o + sin_n * sin_o).clamp_(-1.0, 1.0)
    sin_d = (sin_n * cos_o - cos_n * sin_o).clamp_(-1.0, 1.0)
    if is_neox:
        r1 = torch.cat((cos_d, cos_d), dim=-1)
        r2 = torch.cat((sin_d, sin_d), dim=-1)
        mode = "half"
    else:
        r1 = cos_d.repeat_interleave(2, dim=-1)
        r2 = sin_d.repeat_interleave(2, dim=-1)
        mode = "interleave"
    # BSND layout with B = 1: x [1, T, Hkv, R], r1/r2 [1, T, 1, R] (the documented 1S1D form).
    x = k3[..., :rot_dim].to(torch.float32).contiguous().unsqueeze(0)
    r1 = r1[None, :, None, :].contiguous()
    r2 = r2[None, :, None, :].contiguous()
    out = npu().npu_rotary_mul(x, r1, r2, rotary_mode=mode)
    k3[..., :rot_dim].copy_(out[0])
    return k


def rope_unsupported_reason(
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> str | None:
    """Why ``npu_rotary_mul`` cannot serve this call (shape, dtype), or ``None``."""
    rot_dim = cos_sin_cache.shape[-1]
    if k.dtype not in _DTYPES:
        return f"k dtype {k.dtype} not in fp32/fp16/bf16"
    if k.dim() not in (2, 3):
        return f"k is {k.dim()}-D, not [T, H*D] or [T, H, D]"
    if rot_dim % 2 or rot_dim >= _MAX_ROTARY_DIM:
        return f"rotary dim {rot_dim} is odd or >= {_MAX_ROTARY_DIM}"
    heads = k.shape[1] if k.dim() == 3 else k.shape[1] // max(rot_dim, 1)
    if heads >= _MAX_HEADS:
        return f"{heads} key heads >= {_MAX_HEADS}"
    return None


def verify_rope_rerotate_k(k: torch.Tensor, *args, **kwargs) -> str | None:
    """Verifier for the op registry: decline calls the fused op cannot take."""
    return on_npu_reason(k) or rope_unsupported_reason(k, *args, **kwargs)


register("ascend", "rope_rerotate_k", rope_rerotate_k, verify_rope_rerotate_k)
