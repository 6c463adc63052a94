"""A stand-in for a CUDA GPU, for rehearsing vLLM's CUDA code path on a machine without one.

Installed in a process before vLLM is imported (:func:`install`), it makes vLLM's own CUDA
platform class (``vllm.platforms.cuda.CudaPlatform``, subclassed) the current platform with its
tensors on the CPU, and answers the few ``torch.cuda`` / ``torch.accelerator`` calls that CPU torch
cannot (streams and events that run in order, memory figures of a stated size). Triton's kernels
run through Triton's interpreter. vLLM's GPU worker is used with one method replaced,
``init_device`` (it binds CUDA device 0 and reads its free memory; here: the CPU, and the
memory figures below). Everything else -- configuration, scheduler, GPU model runner, KV-cache
allocation, Triton attention, sampler, the KV connector's hooks -- is vLLM's own code.

What a CPU cannot stand in for is left out, and named in ``docs/hardware.md``: CUDA graphs,
compiled attention backends, NCCL, real memory pressure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any

#: the device the stand-in reports: an H100's compute capability; memory a CPU can hold (vLLM
#: allocates its KV-cache pool as a share of it)
CAPABILITY = (9, 0)
TOTAL_MEMORY = 2 << 30
FREE_MEMORY = (2 << 30) - (64 << 20)
NAME = "CPU standing in for an NVIDIA GPU"


class _Stream:
    """``torch.cuda.Stream`` on a CPU: work is done when it is issued."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event or _Event()

    def query(self) -> bool:
        return True


class _Event:
    """``torch.cuda.Event`` on a CPU: always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_STREAM = _Stream()

#: the modules of vLLM this process stands in for (the rehearsal reports them)
STOOD_IN: list[str] = []


def _patch_torch() -> None:
    import torch

    cuda = torch.cuda
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _STREAM
    cuda.default_stream = lambda device=None: _STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.mem_get_info = lambda device=None: (FREE_MEMORY, TOTAL_MEMORY)
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.memory_stats = lambda device=None: {}
    cuda.current_device = lambda: 0
    cuda.get_device_capability = lambda device=None: CAPABILITY
    cuda.get_device_name = lambda device=None: NAME
    cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        name=NAME,
        major=CAPABILITY[0],
        minor=CAPABILITY[1],
        total_memory=TOTAL_MEMORY,
        multi_processor_count=132,
        is_integrated=False,
        L2_cache_size=50 << 20,
        gcnArchName="",
    )
    acc = torch.accelerator
    acc.device_count = lambda: 1
    acc.set_device_index = lambda device: None
    acc.current_device_index = lambda: 0
    acc.synchronize = lambda device=None: None
    acc.empty_cache = lambda: None
    acc.memory_stats = lambda device=None: {}
    acc.get_memory_info = lambda device=None: (FREE_MEMORY, TOTAL_MEMORY)
    acc.reset_peak_memory_stats = lambda device=None: None
    acc.max_memory_allocated = lambda device=None: 0
    acc.memory_allocated = lambda device=None: 0
    acc.memory_reserved = lambda device=None: 0
    acc.max_memory_reserved = lambda device=None: 0


def _patch_triton() -> None:
    """vLLM turns Triton off unless exactly one Triton driver is active (the interpreter
    needs none)."""
    from triton.backends import backends

    nvidia = backends.get("nvidia")
    if nvidia is not None and nvidia.driver is not None:
        nvidia.driver.is_active = staticmethod(lambda: True)
    for name, backend in backends.items():
        if name != "nvidia" and backend.driver is not None:
            backend.driver.is_active = staticmethod(lambda: False)


def _platform() -> Any:
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    class CpuStandingInForCuda(cuda.CudaPlatform):
        """vLLM's CUDA platform with its tensors on the CPU (see the module docstring)."""

        device_type = "cpu"
        dist_backend = "gloo"
        dispatch_key = "CPU"  # vLLM registers its own torch ops for the platform's key

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*CAPABILITY)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return NAME

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return "cpu-standing-in-for-cuda"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return TOTAL_MEMORY

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

        @classmethod
        def device_count(cls) -> int:
            return 1

        @classmethod
        def set_device(cls, device: Any) -> None:
            pass

        @classmethod
        def is_integrated_gpu(cls, device_id: int = 0) -> bool:
            return False

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 132

    return CpuStandingInForCuda()


def _init_device(self: Any) -> None:
    """``Worker.init_device`` with the CPU as the device (vLLM's binds CUDA device 0)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.utils.torch_utils import set_random_seed
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
    from vllm.v1.worker.utils import request_memory
    from vllm.v1.worker.workspace import init_workspace_manager

    self.device = torch.device("cpu")
    current_platform.check_if_supports_dtype(self.model_config.dtype)
    init_worker_distributed_environment(
        self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, "gloo"
    )
    set_random_seed(self.model_config.seed)
    self.init_snapshot = MemorySnapshot(device=self.device)
    self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
    init_workspace_manager(self.device, 1)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    self.model_runner = GPUModelRunner(self.vllm_config, self.device)


def _without_torchvision() -> None:
    """vLLM 0.26's kernel warm-up imports the MiniMax-M3 model, which imports torchvision. The
    bundle's torchvision is built for the GPU machine's torch (2.11, CUDA) and cannot load beside
    CPU torch, so where torchvision does not import, that one warm-up (a no-op for a Llama: it
    looks for MiniMax-M3's sparse attention) is stood in for."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or a build for another torch
        name = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
        module = types.ModuleType(name, "stand-in: the real module imports torchvision")
        module.minimax_m3_msa_warmup = lambda worker: None
        sys.modules[name] = module
        STOOD_IN.append(name)


def install() -> None:
    """Make this process's vLLM run its CUDA path on the CPU. Call before importing vLLM."""
    from lmcache_backend.settings.writer import export

    os.environ["TRITON_INTERPRET"] = "1"  # read once, when triton is first imported
    export(vllm_enable_v1_multiprocessing=False)  # one process: the mock is in it
    _patch_torch()
    _patch_triton()
    _without_torchvision()
    import vllm.platforms

    vllm.platforms._current_platform = _platform()
    # read once at import, possibly before the platform above was in place
    import vllm.utils.torch_utils

    vllm.utils.torch_utils.PIN_MEMORY = False
    from vllm.v1.worker import gpu_worker

    gpu_worker.Worker.init_device = _init_device
    # lmcache-backend asks vLLM's platform which code path to take: the CUDA one, as on a GPU
    # (the platform's device_type says "cpu" only because its tensors live there)
    from lmcache_backend import device

    device.engine_platform = lambda: "cuda"
    device.detect_platform = lambda: "cuda"
