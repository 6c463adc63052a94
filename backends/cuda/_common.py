"""Helpers shared by the Triton launchers and their verifiers (no Triton import here)."""

from __future__ import annotations

import contextlib
import math

import torch

from lmcache_backend.settings import read_variable

# Storage dtypes the kernels load and store; the math is fp32 whatever the storage.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(read_variable("TRITON_INTERPRET"))


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def device_reason(*tensors: torch.Tensor) -> str | None:
    """Reason the kernels cannot take these tensors, or ``None``.

    Compiled kernels need every tensor on one CUDA device; the interpreter runs on CPU tensors.
    """
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return "tensors on different devices"
    (device,) = devices
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpret_mode():
        return None
    return f"tensors on {device.type}, not cuda"


def float_dtype_reason(name: str, t: torch.Tensor) -> str | None:
    """Reason to decline when ``t`` is not fp32/fp16/bf16, else ``None``."""
    if t.dtype not in FLOAT_DTYPES:
        return f"{name} dtype {t.dtype} not in fp32/fp16/bf16"
    return None


def index_reason(name: str, t: torch.Tensor, length: int | None = None) -> str | None:
    """Reason to decline unless ``t`` is a 1-D int32/int64 tensor (of ``length``), else ``None``."""
    if t.dtype not in INDEX_DTYPES:
        return f"{name} dtype {t.dtype} is not int32/int64"
    if t.dim() != 1:
        return f"{name} is {t.dim()}-D, not 1-D"
    if length is not None and t.shape[0] != length:
        return f"{name} has {t.shape[0]} entries, expected {length}"
    return None


def rows_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x [T, ...]`` as ``[T, F]`` with contiguous features and any row stride, without a copy.

    Returns ``None`` when no such view exists (features not laid out contiguously within a row).
    """
    features = math.prod(x.shape[1:])
    try:
        flat = x.view(x.shape[0], features)
    except RuntimeError:
        return None
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        return None
    return flat


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x [T, ...]`` as ``[T, F]`` with contiguous features: a view if one exists, else a copy."""
    flat = rows_view(x)
    if flat is None:
        flat = x.reshape(x.shape[0], math.prod(x.shape[1:])).contiguous()
    return flat


def device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s GPU the current one for a launch (Triton launches on the current device)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
