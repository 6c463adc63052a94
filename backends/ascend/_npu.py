"""The one place the Ascend backend reaches ``torch_npu``.

Every op module calls :func:`npu` for the ``torch_npu`` module instead of importing it, so that
importing the backend never imports ``torch_npu`` (and so never needs CANN), and so that a test can
substitute a CPU emulation of the operators with :func:`use_npu_module`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

_substitute: Any = None


def npu() -> Any:
    """Return the module whose ``npu_*`` operators the backend calls (``torch_npu`` by default)."""
    if _substitute is not None:
        return _substitute
    import torch_npu  # imported on first use only: it loads CANN

    return torch_npu


@contextlib.contextmanager
def use_npu_module(module: ModuleType | Any) -> Iterator[None]:
    """Within the block, route every operator call to ``module`` instead of ``torch_npu``.

    ``module`` must provide the operators the backend calls, with torch_npu's signatures.
    """
    global _substitute
    previous = _substitute
    _substitute = module
    try:
        yield
    finally:
        _substitute = previous


def on_npu_reason(*tensors: Any) -> str | None:
    """Reason the backend cannot take these tensors (not all on one NPU), else ``None``."""
    devices = {t.device for t in tensors if hasattr(t, "device")}
    if len(devices) > 1:
        return "tensors on different devices"
    if devices and next(iter(devices)).type != "npu":
        return f"tensors on {next(iter(devices)).type}, not npu"
    return None
