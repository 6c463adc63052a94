"""Which accelerator platform this process runs on, detected once and cached.

Platforms are named ``"cuda"``, ``"rocm"``, ``"xpu"``, ``"npu"`` and ``"cpu"`` everywhere in the
package (``"tpu"`` or another vLLM device type may come from :func:`engine_platform`). CacheBlend
supports CUDA, Ascend NPUs and CPU; ROCm and XPU are told apart only to refuse them with a clear
line (:func:`unsupported_platform_reason`), not routed to the CUDA code.

Two detectors, both cached:

* :func:`detect_platform` asks torch (``torch.version.hip`` for ROCm builds, which also answer
  ``torch.cuda.is_available()``; ``torch_npu``; ``torch.xpu``). The op registry and ``doctor``
  use it.
* :func:`engine_platform` asks vLLM (``vllm.platforms.current_platform``), which has already
  resolved the platform in a vLLM process, including out-of-tree ones such as vllm-ascend's NPU
  platform, without initialising CUDA (vLLM probes with NVML, and a parent that initialised CUDA
  cannot fork workers that use it). The vLLM integration uses it.

Nothing here imports ``torch_npu`` or vLLM at module import: they are probed only when asked.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

SUPPORTED_PLATFORMS = ("cuda", "npu", "cpu")

#: Names in messages.
PLATFORM_NAMES = {
    "cuda": "CUDA",
    "npu": "Ascend NPU",
    "cpu": "CPU",
    "rocm": "ROCm",
    "xpu": "Intel XPU",
    "tpu": "TPU",
}


def _probe_platform() -> str:
    """One uncached torch-based detection (see :func:`detect_platform`)."""
    if torch.cuda.is_available():
        # ROCm builds of torch expose AMD GPUs through torch.cuda; only torch.version.hip
        # tells them apart.
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if npu_unavailable_reason() is None:
        return "npu"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    return "cpu"


@functools.lru_cache(maxsize=1)
def detect_platform() -> str:
    """``"cuda"``, ``"rocm"``, ``"npu"``, ``"xpu"`` or ``"cpu"``: the devices this process's
    torch can use."""
    return _probe_platform()


def platform_of(vllm_platform: Any) -> str:
    """A vLLM ``Platform`` object's platform in this module's names."""
    if vllm_platform.is_rocm():  # device_type is "cuda" on ROCm
        return "rocm"
    return str(vllm_platform.device_type)


@functools.lru_cache(maxsize=1)
def engine_platform() -> str:
    """The platform vLLM resolved for this process; :func:`detect_platform` without vLLM."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return detect_platform()
    return platform_of(current_platform)


def unsupported_platform_reason(platform: str) -> str | None:
    """None for a supported platform, else one line saying so."""
    if platform in SUPPORTED_PLATFORMS:
        return None
    name = PLATFORM_NAMES.get(platform, platform)
    return (
        f"CacheBlend does not support {name} yet (supported: CUDA, Ascend NPU, CPU); "
        "serve this model without the CacheBlend connector"
    )


@functools.lru_cache(maxsize=1)
def npu_unavailable_reason() -> str | None:
    """``None`` when an Ascend NPU is usable, otherwise what is missing, in words."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (this package's [ascend] extra brings it)"
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # CANN missing or mismatched raises all sorts of errors
        return f"torch_npu failed to import (is CANN installed and sourced?): {exc}"
    if not hasattr(torch, "npu") or not torch.npu.is_available():
        return "torch_npu imported but torch.npu.is_available() is False (no NPU visible)"
    return None
