"""The blend's own CPU kernel: tiled attention of selected queries (``tiled_attention.cpp``).

Built with the system's C++ compiler on first use (about 30 s, once per machine and torch
version: the library is kept under ``$LMCACHE_KERNEL_CACHE``, default
``~/.cache/lmcache_backend/kernels``) and only where it can run: x86-64 with AVX-512 BF16, whose
bf16 matrix products it takes from oneDNN through torch. Anything else gets
:class:`KernelUnavailable` with the reason, and the caller keeps vLLM's attention.

It is the CPU backend's ``attention_at_positions`` (registered by :func:`register_ops`): a query
at position ``p`` attends keys ``0..p``, as the torch reference; its verifier leaves every call
it cannot serve (not bf16, a head dim that is not a multiple of 32, ...) to the reference.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from lmcache_backend.ops import register
from lmcache_backend.ops.reference import window_reason
from lmcache_backend.settings import read_variable

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("tiled_attention.cpp")
#: most selected queries per tile (the kernel cuts them into tiles of equal size): rows of
#: one product are at most ``TILE_QUERIES x (Hq / Hkv)``
TILE_QUERIES = 16
#: the CPU flags the kernel is compiled for (``-march=native`` must include them)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

#: ``tiled_attention(q [N, Hq, D], positions [N], k [T, Hkv, D], v [T, Hkv, D], scale,
#: window=None)``
TiledAttention = Callable[..., torch.Tensor]
#: compiled for this machine's CPU (checked against REQUIRED_FLAGS first); ATen's vector
#: types in their AVX-512 form; OpenMP on, or ATen's parallel_for (inline in its headers) runs
#: on one thread. The library then shares torch's own libgomp (the same soname, loaded first).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
LDFLAGS = ["-fopenmp"]


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def unsupported_reason() -> str | None:
    """Why the kernel cannot run on this machine, or None when it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64, this is {platform.machine()}"
    missing = [flag for flag in REQUIRED_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"needs the CPU flags {', '.join(missing)}"
    if not torch.backends.mkldnn.is_available():
        return "needs torch built with oneDNN (mkldnn)"
    return None


def _cache_dir() -> Path:
    root = read_variable("LMCACHE_KERNEL_CACHE") or Path.home() / ".cache/lmcache_backend/kernels"
    return Path(root)


def _build(name: str, library: Path) -> ModuleType:
    """Compile the kernel in a folder of this process's own, then move the library into the
    cache in one step. No lock is shared between processes: a build that dies (a killed test
    run, an engine stopped during its first start) leaves only its own folder behind, never a
    lock another process would wait on forever (torch's loader waits on its ``lock`` file
    without a time limit); two processes building at once both succeed, the last move wins."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH; the pip-installed one sits next to this interpreter
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix=f"{name}.build-", dir=library.parent) as build:
        module = cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            # copies: torch appends its own flags to these lists
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=build,
            verbose=False,
        )
        # the loaded library stays mapped after its file moves
        os.replace(Path(build) / f"{name}.so", library)
    return module


def _import_library(name: str, library: Path) -> ModuleType:
    """Import the Python extension module ``name`` from an already built ``library``."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the kernel library {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def load_tiled_attention() -> TiledAttention:
    """The compiled kernel (built on first call, then loaded from the cache).

    Raises:
        KernelUnavailable: the CPU cannot run it, or it does not build (no compiler, ...).
    """
    reason = unsupported_reason()
    if reason is not None:
        raise KernelUnavailable(f"tiled attention {reason}")
    source = SOURCE.read_bytes()
    # one library per source and torch version: an edited kernel is never a stale one
    flags = " ".join(CFLAGS + LDFLAGS + [torch.__version__]).encode()
    name = f"lmcache_tiled_attention_{hashlib.sha256(source + flags).hexdigest()[:12]}"
    library = _cache_dir() / f"{name}.so"
    try:
        module = _import_library(name, library) if library.exists() else _build(name, library)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"tiled attention did not build: {exc}") from exc
    logger.info("tiled attention kernel loaded from %s", library)

    def tiled_attention(
        q: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at sorted ``positions [N]`` over ``k``/``v`` ``[T, Hkv, D]`` (row
        ``t`` is position ``t``), bf16 -> ``[N, Hq, D]`` bf16, each query over keys ``0..p``,
        or ``p - window + 1 .. p`` with a sliding ``window``."""
        return module.tiled_attention(
            q.contiguous(),
            positions.cpu(),
            k.contiguous(),
            v.contiguous(),
            scale,
            TILE_QUERIES,
            window or 0,
        )

    return tiled_attention


def verify_attention_at_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float = 1.0,
    *,
    window: int | None = None,
) -> str | None:
    """Why the tiled kernel cannot serve this ``attention_at_positions`` call, or None."""
    reason = window_reason(window)
    if reason:
        return reason
    tensors = (q, k, v)
    if any(t.device.type != "cpu" for t in (*tensors, q_positions)):
        return "not CPU tensors"
    if any(t.dtype != torch.bfloat16 for t in tensors):
        return f"needs bf16 q/k/v, got {q.dtype}/{k.dtype}/{v.dtype}"
    if any(t.dim() != 3 for t in tensors) or k.shape != v.shape:
        return "needs q [N, Hq, D] and k, v [T, Hkv, D] of one shape"
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if k.shape[2] != dim or dim % 32 or heads % kv_heads:
        return f"needs a head dim multiple of 32 and whole query groups, got {tuple(q.shape)}"
    if q_positions.numel() and (
        bool((q_positions[1:] < q_positions[:-1]).any()) or int(q_positions[-1]) >= k.shape[0]
    ):
        return "needs sorted query positions within the keys"
    return None


def register_ops() -> None:
    """Build (or load) the kernel and register it as the CPU backend's
    ``attention_at_positions``.

    Raises:
        KernelUnavailable: the kernel cannot run here (the message says why).
    """
    kernel = load_tiled_attention()

    def attention_at_positions(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_positions: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at sorted ``q_positions [N]`` over ``k``/``v`` ``[T, Hkv, D]``,
        bf16 -> ``[N, Hq, D]`` bf16; the query at position ``p`` attends keys ``0..p``
        (``p - window + 1 .. p`` with a sliding ``window``)."""
        return kernel(q, q_positions, k, v, float(scale), window)

    register("cpu", "attention_at_positions", attention_at_positions, verify_attention_at_positions)
