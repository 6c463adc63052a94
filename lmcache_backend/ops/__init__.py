"""The op registry: one object with the same op names on every backend.

``get_ops("torch" | "cuda" | "ascend" | "auto")`` returns an :class:`Ops`. ``LMCACHE_BACKEND``
(or the ``backend`` config key) chooses when no name is given. A backend module exposes
``load() -> dict[str, Callable]`` with the ops it implements (raising
:class:`BackendUnavailable` with the reason when it cannot run here) and, optionally,
``VERIFIERS: dict[str, Callable[..., str | None]]``: a verifier returns a reason to decline a call
(shape, dtype), which then goes to the torch reference, logged once per op and reason.

An explicit choice that cannot load raises; ``auto`` falls back to the reference and logs once.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_backend.ops.device import detect_platform
from lmcache_backend.ops.reference import REFERENCE_OPS

logger = logging.getLogger(__name__)

OP_NAMES = tuple(REFERENCE_OPS)
BACKEND_NAMES = ("torch", "cuda", "ascend")
BACKEND_CHOICES = ("auto",) + BACKEND_NAMES

# backend name -> module whose ``load()`` returns its ops
_BACKEND_MODULES = {
    "cuda": "lmcache_backend.backends.cuda",
    "ascend": "lmcache_backend.backends.ascend",
}
# ROCm and XPU have no backend of their own (the CUDA kernels are not run there): the reference
_AUTO_BY_PLATFORM = {
    "cuda": "cuda",
    "npu": "ascend",
    "cpu": "torch",
    "rocm": "torch",
    "xpu": "torch",
}


class BackendUnavailable(RuntimeError):
    """A backend cannot run in this process; the message says why."""


@dataclass(frozen=True)
class Ops:
    """The op set of one backend; see ``DESIGN.md`` ("The ops every backend provides")."""

    name: str
    rope_rerotate_k: Callable
    kv_deviation_topk: Callable
    gather_rows: Callable
    scatter_rows: Callable
    attention_at_positions: Callable
    paged_kv_write: Callable
    paged_kv_read: Callable
    # op name -> backend that serves it ("torch" where the backend left it to the reference)
    served_by: tuple[tuple[str, str], ...] = ()


_declined_logged: set[tuple[str, str, str]] = set()


def _with_verifier(backend: str, op: str, fn: Callable, verify: Callable) -> Callable:
    reference = REFERENCE_OPS[op]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        reason = verify(*args, **kwargs)
        if reason is None:
            return fn(*args, **kwargs)
        key = (backend, op, reason)
        if key not in _declined_logged:
            _declined_logged.add(key)
            logger.info(
                "%s backend declined %s (%s); using the torch reference", backend, op, reason
            )
        return reference(*args, **kwargs)

    return call


def _load_backend(name: str) -> Ops:
    if name == "torch":
        return Ops(name="torch", **REFERENCE_OPS, served_by=tuple((op, "torch") for op in OP_NAMES))
    try:
        module = importlib.import_module(_BACKEND_MODULES[name])
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} failed to import: {exc}") from exc
    implemented = module.load()
    verifiers = getattr(module, "VERIFIERS", {})
    unknown = set(implemented) - set(OP_NAMES)
    if unknown:
        raise BackendUnavailable(f"backend {name!r} provides unknown ops {sorted(unknown)}")
    ops = {}
    served_by = []
    for op in OP_NAMES:
        fn = implemented.get(op)
        if fn is None:
            ops[op] = REFERENCE_OPS[op]
            served_by.append((op, "torch"))
            continue
        if op in verifiers:
            fn = _with_verifier(name, op, fn, verifiers[op])
        ops[op] = fn
        served_by.append((op, name))
    return Ops(name=name, **ops, served_by=tuple(served_by))


@functools.cache
def _get_ops_cached(name: str) -> Ops:
    if name != "auto":
        return _load_backend(name)
    preferred = _AUTO_BY_PLATFORM.get(detect_platform(), "torch")
    try:
        return _load_backend(preferred)
    except BackendUnavailable as exc:
        logger.warning("LMCACHE_BACKEND=auto: %s; falling back to the torch reference ops", exc)
        return _load_backend("torch")


def get_ops(name: str | None = None) -> Ops:
    """Return the op set for ``name`` (default: ``$LMCACHE_BACKEND``, else ``"auto"``).

    Raises:
        ValueError: ``name`` is not one of ``auto``, ``torch``, ``cuda``, ``ascend``.
        BackendUnavailable: an explicitly named backend cannot run here (the message says why).
    """
    if name is None:
        name = os.environ.get("LMCACHE_BACKEND", "auto")
    name = name.strip().lower()
    if name not in BACKEND_CHOICES:
        raise ValueError(f"backend: {name!r} is not one of {', '.join(BACKEND_CHOICES)}")
    return _get_ops_cached(name)


__all__ = ["BACKEND_CHOICES", "BackendUnavailable", "OP_NAMES", "Ops", "get_ops"]
