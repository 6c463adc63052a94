"""CPU backend: the torch references plus the blend's tiled attention kernel (installed as
``lmcache_backend.backends.cpu``).

Only ``attention_at_positions`` has a kernel of its own (:mod:`.tiled_attention`, x86-64 with
AVX-512 BF16, bf16 tensors); every other op is the reference. Importing this package builds
nothing: :func:`load` builds the kernel (about 30 s the first time on a machine).
"""

from __future__ import annotations

from lmcache_backend.ops import BackendUnavailable


def load() -> None:
    """Build (or load) the tiled kernel and register it.

    Raises:
        BackendUnavailable: the kernel cannot run or be built here (the message says why).
    """
    from lmcache_backend.backends.cpu.tiled_attention import KernelUnavailable, register_ops

    try:
        register_ops()
    except KernelUnavailable as exc:
        raise BackendUnavailable(str(exc)) from exc
