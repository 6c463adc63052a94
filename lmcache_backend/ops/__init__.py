"""The op registry: one object with the same op names on every backend.

The op set is :class:`Ops`' fields, each op named as its torch reference in
:mod:`lmcache_backend.ops.reference` (whose docstring is the op's signature and meaning). A
backend registers the ops it implements with :func:`register`, each with an optional *verifier*
that returns a reason to decline a call (shape, dtype, device), which then goes to the
reference, logged once per op and reason. Backends:

* ``torch``: the references themselves;
* ``cpu``: the references plus the blend's tiled attention kernel
  (:mod:`lmcache_backend.backends.cpu`, x86-64 with AVX-512 BF16);
* ``cuda``: Triton kernels (:mod:`lmcache_backend.backends.cuda`);
* ``ascend``: torch-npu operators (:mod:`lmcache_backend.backends.ascend`).

``get_ops("torch" | "cpu" | "cuda" | "ascend" | "auto")`` returns an :class:`Ops`;
``LMCACHE_BACKEND`` (or the ``backend`` config key) chooses when no name is given. ``auto`` picks
the platform's backend and falls back to ``torch`` when it cannot load (logged once); an
explicit choice that cannot load raises with the reason.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from lmcache_backend.device import detect_platform
from lmcache_backend.ops import reference
from lmcache_backend.settings import BACKEND_CHOICES
from lmcache_backend.settings.sources import configured

logger = logging.getLogger(__name__)

BACKEND_NAMES = tuple(name for name in BACKEND_CHOICES if name != "auto")

# backend name -> module whose ``load()`` makes its ops available (registering them)
_BACKEND_MODULES = {
    "cpu": "lmcache_backend.backends.cpu",
    "cuda": "lmcache_backend.backends.cuda",
    "ascend": "lmcache_backend.backends.ascend",
}
# ROCm and XPU have no backend of their own (the CUDA kernels are not run there): the reference
_AUTO_BY_PLATFORM = {
    "cuda": "cuda",
    "npu": "ascend",
    "cpu": "cpu",
    "rocm": "torch",
    "xpu": "torch",
}

#: ``verify(*args, **kwargs) -> reason to decline the call, or None``
Verifier = Callable[..., "str | None"]


class BackendUnavailable(RuntimeError):
    """A backend cannot run in this process; the message says why."""


@dataclass(frozen=True)
class Ops:
    """The op set of one backend (the same names and signatures as
    :mod:`lmcache_backend.ops.reference`; see ``DESIGN.md``, "The ops every backend provides").

    Attributes:
        name: the backend.
        served_by: ``(op, backend)`` pairs: which backend serves each op (``"torch"`` where
            the backend left it to the reference).
        verifiers: op -> the verifier of the backend's implementation, where it has one.
        fallback_reason: why ``auto`` fell back to these ops from the platform's backend.
    """

    name: str
    rope_rerotate_k: Callable
    kv_deviation_topk: Callable
    gather_rows: Callable
    scatter_rows: Callable
    attention_at_positions: Callable
    paged_kv_write: Callable
    paged_kv_read: Callable
    paged_attention_at_positions: Callable
    served_by: tuple[tuple[str, str], ...] = ()
    verifiers: dict[str, Verifier] = field(default_factory=dict, compare=False)
    fallback_reason: str | None = None

    def native(self, op: str) -> bool:
        """Whether ``op`` runs on this backend's own implementation (not the reference)."""
        return dict(self.served_by).get(op, "torch") != "torch"

    def decline_reason(self, op: str, *args, **kwargs) -> str | None:
        """Why a call of ``op`` with these arguments would go to the torch reference (the op
        is not implemented here, or its verifier declines them), or None."""
        if not self.native(op):
            why = f" ({self.fallback_reason})" if self.fallback_reason else ""
            return f"{op} is served by the torch reference on backend {self.name!r}{why}"
        verify = self.verifiers.get(op)
        return None if verify is None else verify(*args, **kwargs)


#: the ops every backend provides: :class:`Ops`' callable fields, in their order
OP_NAMES = tuple(f.name for f in fields(Ops) if f.type == "Callable")

# backend -> op -> (implementation, verifier or None)
_REGISTERED: dict[str, dict[str, tuple[Callable, Verifier | None]]] = {}


def register(backend: str, op: str, fn: Callable, verify: Verifier | None = None) -> None:
    """Register ``fn`` as ``backend``'s implementation of ``op`` (called by the backend's kernel
    modules when they are imported), with ``verify`` deciding which calls it declines.

    Raises:
        ValueError: ``op`` is not one of :data:`OP_NAMES`.
    """
    if op not in OP_NAMES:
        raise ValueError(f"backend {backend!r} registers unknown op {op!r} (ops: {OP_NAMES})")
    _REGISTERED.setdefault(backend, {})[op] = (fn, verify)


def implementations(backend: str) -> dict[str, Callable]:
    """The ops ``backend``'s imported modules registered, by name (without their verifiers)."""
    return {op: fn for op, (fn, _) in _REGISTERED.get(backend, {}).items()}


_declined_logged: set[tuple[str, str, str]] = set()


def _with_verifier(backend: str, op: str, fn: Callable, verify: Verifier) -> Callable:
    fallback = getattr(reference, op)

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
        return fallback(*args, **kwargs)

    return call


def _load_backend(name: str) -> Ops:
    if name != "torch":
        try:
            module = importlib.import_module(_BACKEND_MODULES[name])
        except ImportError as exc:
            raise BackendUnavailable(f"backend {name!r} failed to import: {exc}") from exc
        module.load()
    registered = _REGISTERED.get(name, {})
    ops, served_by, verifiers = {}, [], {}
    for op in OP_NAMES:
        fn, verify = registered.get(op, (getattr(reference, op), None))
        if op in registered and verify is not None:
            verifiers[op] = verify
            fn = _with_verifier(name, op, fn, verify)
        ops[op] = fn
        served_by.append((op, name if op in registered else "torch"))
    return Ops(name=name, **ops, served_by=tuple(served_by), verifiers=verifiers)


@functools.cache
def _get_ops_cached(name: str) -> Ops:
    if name != "auto":
        return _load_backend(name)
    preferred = _AUTO_BY_PLATFORM.get(detect_platform(), "torch")
    try:
        return _load_backend(preferred)
    except BackendUnavailable as exc:
        logger.warning("LMCACHE_BACKEND=auto: %s; falling back to the torch reference ops", exc)
        return replace(_load_backend("torch"), fallback_reason=f"{preferred} backend: {exc}")


def get_ops(name: str | None = None) -> Ops:
    """Return the op set for ``name`` (default: the configured ``backend``: ``LMCACHE_BACKEND``,
    else the YAML file's, else ``"auto"``).

    Raises:
        ValueError: ``name`` is not one of ``auto``, ``torch``, ``cpu``, ``cuda``, ``ascend``.
        BackendUnavailable: an explicitly named backend cannot run here (the message says why).
    """
    if name is None:
        name = configured("backend")
    name = name.strip().lower()
    if name not in BACKEND_CHOICES:
        raise ValueError(f"backend: {name!r} is not one of {', '.join(BACKEND_CHOICES)}")
    return _get_ops_cached(name)


__all__ = [
    "BACKEND_CHOICES",
    "BackendUnavailable",
    "OP_NAMES",
    "Ops",
    "get_ops",
    "implementations",
    "register",
]
