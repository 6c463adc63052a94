"""Which accelerator this process has, detected once and cached.

Nothing here imports ``torch_npu`` at module import: it is probed only when asked.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=1)
def detect_platform() -> str:
    """Return ``"cuda"``, ``"npu"`` or ``"cpu"`` for the devices this process can use."""
    if torch.cuda.is_available():
        return "cuda"
    if npu_unavailable_reason() is None:
        return "npu"
    return "cpu"


@functools.lru_cache(maxsize=1)
def npu_unavailable_reason() -> str | None:
    """``None`` when an Ascend NPU is usable, otherwise what is missing, in words."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (pip install 'lmcache-backend[ascend]')"
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # CANN missing or mismatched raises all sorts of errors
        return f"torch_npu failed to import (is CANN installed and sourced?): {exc}"
    if not hasattr(torch, "npu") or not torch.npu.is_available():
        return "torch_npu imported but torch.npu.is_available() is False (no NPU visible)"
    return None
