"""Count what a piece of code asks of the device: kernel launches and host-device
synchronisations, op by op, on whatever device its tensors live.

:class:`LaunchCounter` is a context manager over the calling thread. It counts

* **launches**: every dispatched aten (or custom) op that does work -- views, allocations and
  metadata queries do not -- plus one per Triton kernel launch (the ops Triton's interpreter runs
  on the host to emulate a kernel are not counted). On CPU tensors this predicts what the same
  code launches on a GPU, where each such op is (at least) one kernel;
* **syncs**: the calls that make the host wait for the device on a GPU: reading a value back
  (``int(t)``, ``bool(t)``, ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, a copy to the
  host), and the ops whose output size depends on the data (``nonzero``, boolean indexing,
  ``masked_select``, ``unique``, ``torch.equal``). Each is recorded with the innermost frame of
  this package (or the benchmarks) that made it, so a new one is easy to find.

It does not see a host->device copy of a host tensor where both are CPU tensors (a ``.to(device)``
that is a no-op there): on a GPU, ``torch.cuda.set_sync_debug_mode`` reports those
(:func:`cuda_syncs`).

Counting per layer: run the same request on models of two depths and divide the difference by
the difference in layers (what the blend tests and the hardware check do), so the work done once
per request cancels out.
"""

from __future__ import annotations

import collections
import os
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose output size depends on the data, or that read a value back to the host
_SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::nonzero",
        "aten::masked_select",
        "aten::equal",
        "aten::unique_consecutive",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
    }
)
#: aten ops that allocate without writing
_ALLOCATIONS = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::lift_fresh",
        "aten::detach",
        "aten::alias",
    }
)
#: Tensor methods that read a tensor back to the host without an aten op on CPU tensors
_HOST_READS = frozenset({"cpu", "tolist", "numpy"})
#: frames that say where a sync comes from
_OWN_CODE = (f"{os.sep}lmcache_backend{os.sep}", f"{os.sep}benchmarks{os.sep}")


@dataclass
class Counts:
    """What one counted block did.

    Attributes:
        launches: kernel launches (aten ops that do work, and Triton launches).
        triton: of which Triton launches.
        syncs: host-device synchronisations.
        sync_sites: ``"<what> <file>:<line>"`` -> how many, for the syncs.
        ops: aten op name -> launches.
    """

    launches: int = 0
    triton: int = 0
    syncs: int = 0
    sync_sites: collections.Counter = field(default_factory=collections.Counter)
    ops: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "launches": self.launches,
            "triton": self.triton,
            "syncs": self.syncs,
            "sync_sites": dict(self.sync_sites.most_common()),
        }


def _site(what: str) -> str:
    """``what`` with the innermost frame of this package or the benchmarks that called it."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != __file__ and any(part in frame.filename for part in _OWN_CODE):
            return f"{what} {os.path.basename(frame.filename)}:{frame.lineno}"
    return f"{what} (outside the package)"


def _is_view(func: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _bool_index(args: tuple) -> bool:
    """Whether an ``index``/``index_put`` call indexes with a boolean mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def _device_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether an aten copy moves a device tensor to the host."""
    if name == "aten::_to_copy":
        device = kwargs.get("device")
        source = args[0] if args else None
    elif name == "aten::copy_" and len(args) > 1:
        device, source = args[0].device, args[1]
    else:
        return False
    return (
        device is not None
        and torch.device(device).type == "cpu"
        and isinstance(source, torch.Tensor)
        and source.device.type != "cpu"
    )


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: LaunchCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.owner._aten(func, args, kwargs)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: LaunchCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in _HOST_READS:
            return func(*args, **kwargs)
        self.owner._sync(f"Tensor.{name}")
        self.owner._quiet += 1  # its own aten ops (a device->host copy) are this sync
        try:
            return func(*args, **kwargs)
        finally:
            self.owner._quiet -= 1


class LaunchCounter:
    """Counts launches and syncs of the calling thread while active (see the module docstring).

    Use::

        with LaunchCounter() as counter:
            run()
        counter.counts.launches, counter.counts.syncs
    """

    _triton_lock = threading.Lock()

    def __init__(self) -> None:
        self.counts = Counts()
        self._quiet = 0  # inside a Triton launch or a counted host read
        self._thread = threading.get_ident()
        self._modes: list[Any] = []
        self._restore: Callable[[], None] | None = None

    def _aten(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self._quiet or threading.get_ident() != self._thread:
            return
        name = func._schema.name
        if (
            name in _SYNC_OPS
            or (name.startswith("aten::index") and _bool_index(args))
            or _device_to_host(name, args, kwargs)
        ):
            self._sync(name)
            if name in ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"):
                return  # a read, not a launch
        if name in _ALLOCATIONS or _is_view(func):
            return
        self.counts.launches += 1
        self.counts.ops[name] += 1

    def _sync(self, what: str) -> None:
        if self._quiet:
            return
        self.counts.syncs += 1
        self.counts.sync_sites[_site(what)] += 1

    def _triton(self, run: Callable, *args: Any, **kwargs: Any) -> Any:
        mine = threading.get_ident() == self._thread and not self._quiet
        if mine:
            self.counts.launches += 1
            self.counts.triton += 1
        self._quiet += 1
        try:
            return run(*args, **kwargs)
        finally:
            self._quiet -= 1

    def _patch_triton(self) -> Callable[[], None]:
        """Count Triton launches (compiled or interpreted); returns the undo."""
        classes = []
        try:
            from triton.runtime.jit import JITFunction

            classes.append(JITFunction)
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        except ImportError:
            pass
        originals = [(cls, cls.__dict__.get("run")) for cls in classes]
        for cls, original in originals:
            if original is None:
                continue

            def run(fn_self, *args, _original=original, **kwargs):
                return self._triton(_original, fn_self, *args, **kwargs)

            cls.run = run

        def undo() -> None:
            for cls, original in originals:
                if original is not None:
                    cls.run = original

        return undo

    def __enter__(self) -> LaunchCounter:
        self._triton_lock.acquire()
        self._thread = threading.get_ident()
        self._restore = self._patch_triton()
        self._modes = [_Function(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for mode in reversed(self._modes):
                mode.__exit__(*exc)
        finally:
            if self._restore is not None:
                self._restore()
            self._triton_lock.release()


def count(fn: Callable[[], Any]) -> Counts:
    """``fn()``'s launches and syncs (its return value is dropped)."""
    with LaunchCounter() as counter:
        fn()
    return counter.counts


@contextmanager
def cuda_syncs() -> Iterator[list[str]]:
    """On CUDA, the synchronising calls torch itself sees (``set_sync_debug_mode("warn")``:
    device->host copies, pageable host->device copies, ``nonzero``, stream synchronisations),
    one message each, in the yielded list; elsewhere the list stays empty."""
    found: list[str] = []
    if not torch.cuda.is_available():
        yield found
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))
