"""Numerical helpers of the tests: the device they run on, per-dtype tolerances, comparisons.

:data:`DEVICE` is where the tests put their tensors and tiny models: the GPU when one is visible,
so the Triton kernels are compiled and run there; otherwise the CPU, where the same kernels run
through Triton's interpreter (``conftest.py`` sets it).
"""

from __future__ import annotations

import torch

#: the one place that decides the tests' device: ``"cuda"`` or ``"cpu"`` (compare with
#: ``tensor.device.type``)
DEVICE: str = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerances for comparing a backend's output with the fp32 torch reference, per storage dtype:
# (rtol, atol). bf16 keeps 8 mantissa bits, fp16 11.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / max(||expected||, tiny)`` in fp64 — one number per comparison."""
    a = actual.double()
    e = expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``torch.testing.assert_close`` with the tolerance of ``dtype``; NaN never matches."""
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` filled with NaN, so rows an op forgot to write show up."""
    return torch.full_like(t, float("nan"))
