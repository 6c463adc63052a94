"""CUDA backend: Triton kernels for the CacheBlend ops (installed as
``lmcache_backend.backends.cuda``).

Each op family lives in its own module (a private ``_<op>_kernel`` and a public launcher with the
op's name, plus a ``verify_<op>`` that declines calls the kernel cannot serve). Those modules
import Triton, so they are imported by :func:`load` only: importing this package never needs
Triton or a GPU.

The kernels run on CUDA tensors when a GPU is visible, and on CPU tensors through Triton's
interpreter when ``TRITON_INTERPRET=1`` (how they are tested without a GPU).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from lmcache_backend.ops import BackendUnavailable

from ._common import interpret_mode

# Filled by load(): op name -> verifier returning a reason to decline a call, or None.
VERIFIERS: dict[str, Callable[..., str | None]] = {}


def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run in this process, or ``None`` when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'lmcache-backend[cuda]')"
    if torch.cuda.is_available() or interpret_mode():
        return None
    return (
        "no CUDA device is visible (torch.cuda.is_available() is False) and TRITON_INTERPRET "
        "is not 1, so the Triton kernels have nowhere to run"
    )


def load() -> dict[str, Callable]:
    """Return the ops this backend implements.

    Raises:
        BackendUnavailable: the kernels cannot run here (the message says why).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(reason)
    try:
        from . import attention, deviation, paged_kv, rope, rows
    except Exception as exc:  # a broken Triton install fails in many ways
        raise BackendUnavailable(f"the Triton kernels failed to import: {exc}") from exc

    VERIFIERS.update(
        {
            "rope_rerotate_k": rope.verify_rope_rerotate_k,
            "kv_deviation_topk": deviation.verify_kv_deviation_topk,
            "gather_rows": rows.verify_gather_rows,
            "scatter_rows": rows.verify_scatter_rows,
            "attention_at_positions": attention.verify_attention_at_positions,
            "paged_kv_write": paged_kv.verify_paged_kv_write,
            "paged_kv_read": paged_kv.verify_paged_kv_read,
        }
    )
    return {
        "rope_rerotate_k": rope.rope_rerotate_k,
        "kv_deviation_topk": deviation.kv_deviation_topk,
        "gather_rows": rows.gather_rows,
        "scatter_rows": rows.scatter_rows,
        "attention_at_positions": attention.attention_at_positions,
        "paged_kv_write": paged_kv.paged_kv_write,
        "paged_kv_read": paged_kv.paged_kv_read,
    }
