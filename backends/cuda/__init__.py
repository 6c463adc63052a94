"""CUDA backend: Triton kernels for the CacheBlend ops (installed as
``lmcache_backend.backends.cuda``).

Each op family lives in its own module (a private ``_<op>_kernel`` and a public launcher with the
op's name, plus a ``verify_<op>`` that declines calls the kernel cannot serve), which registers
them with the op registry (:func:`lmcache_backend.ops.register`) when imported. Those modules
import Triton, so they are imported by :func:`load` only: importing this package never needs
Triton or a GPU.

The kernels run on CUDA tensors when a GPU is visible, and on CPU tensors through Triton's
interpreter when ``TRITON_INTERPRET=1`` (how they are tested without a GPU).
"""

from __future__ import annotations

import importlib.util

import torch

from lmcache_backend.ops import BackendUnavailable

from ._common import interpret_mode


def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run in this process, or ``None`` when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (this package's [cuda] extra brings it)"
    if torch.cuda.is_available() or interpret_mode():
        return None
    return (
        "no CUDA device is visible (torch.cuda.is_available() is False) and TRITON_INTERPRET "
        "is not 1, so the Triton kernels have nowhere to run"
    )


def load() -> None:
    """Import the kernel modules, which register their ops with the registry.

    Raises:
        BackendUnavailable: the kernels cannot run here (the message says why).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(reason)
    try:
        from . import attention, deviation, paged_attention, paged_kv, rope, rows  # noqa: F401
    except Exception as exc:  # a broken Triton install fails in many ways
        raise BackendUnavailable(f"the Triton kernels failed to import: {exc}") from exc
