"""The KV caches vLLM releases hand to a connector, rebuilt on CPU from the recorded fixtures,
and the reads their attention backends make (for ``test_vllm_layouts_contract.py``).

Each cache is built the way the engine builds it: the recorded *physical* shape is allocated
(filled with NaN) and permuted to the logical shape, so its strides are the engine's. The
backend's read is the fixture's ``kv_read`` code, evaluated on that tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "engine_contracts"
CUDA_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
#: vLLM 0.30+: two of the backends above over one cache, chosen per batch (``composite``).
COMPOSITE_BACKENDS = ("TRITON_FLASH_ATTN", "TRITON_FLASHINFER")


@dataclass(frozen=True)
class Geometry:
    """Cache sizes: ``num_blocks`` blocks of ``block_size`` tokens (as the cache counts them)."""

    dtype: torch.dtype
    heads: int
    head_dim: int
    num_blocks: int
    block_size: int

    def dims(self) -> dict[str, int]:
        """Values of the fixtures' symbolic dims."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.heads,
            "head_size": self.head_dim,
            "head_size_v": self.head_dim,
        }


GEOMETRIES = {
    # GQA model shapes (e.g. Llama-3-8B at TP 1: 8 KV heads of 128) in bf16
    "bf16-H8-D128": Geometry(torch.bfloat16, heads=8, head_dim=128, num_blocks=6, block_size=16),
    "fp32-tiny": Geometry(torch.float32, heads=2, head_dim=4, num_blocks=5, block_size=4),
}


@dataclass(frozen=True)
class Recorded:
    """One recorded (release x backend x layout) tensor, read the way one backend reads it.

    Attributes:
        tensor: the fixture's ``registered_tensor[layout]`` (``logical_shape``,
            ``stride_order``, ``physical_shape``).
        kv_read: the fixture's ``kv_read`` code lines of the backend (of a composite backend:
            those of its child ``reader``).
        reader: the child of a composite backend whose reads these are; None for a plain one.
    """

    version: str
    backend: str
    name: str
    layout: str
    tensor: dict[str, Any]
    kv_read: tuple[str, ...]
    reader: str | None = None

    @property
    def id(self) -> str:
        reader = f"[{self.reader}]" if self.reader else ""
        return f"{self.version}-{self.backend}{reader}-{self.layout}"


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def _index() -> list[dict[str, str]]:
    return json.loads((FIXTURES / "index.json").read_text())["fixtures"]


def load(package: str) -> list[dict[str, Any]]:
    """Every fixture of ``package`` (``vllm`` or ``vllm-ascend``), oldest release first."""
    entries = [e for e in _index() if e["package"] == package]
    entries.sort(key=lambda e: version_key(e["version"]))
    return [json.loads((FIXTURES / e["file"]).read_text()) for e in entries]


def _readers(entry: dict[str, Any]) -> list[tuple[str | None, tuple[str, ...]]]:
    """``(child, kv_read code lines)``: one plain backend's reads, or each child's of a
    composite (whose implementation hands the cache unchanged to the child it picks)."""
    if "composite" not in entry:
        return [(None, tuple(r["code"] for r in entry["kv_read"]))]
    children = [entry["composite"][role]["backend"] for role in ("general", "causal")]
    return [
        (child, tuple(r["code"] for r in entry["kv_read"] if r["child"] == child))
        for child in children
    ]


def recorded_tensors(composites: bool = False) -> list[Recorded]:
    """Every (vLLM release x CUDA backend x layout) the fixtures record; with ``composites``
    also the composite backends, once per child (the same tensors and reads as the children's
    own, under the composite's name)."""
    out = []
    backends = CUDA_BACKENDS + (COMPOSITE_BACKENDS if composites else ())
    for data in load("vllm"):
        if version_key(data["version"]) < (0, 9, 2):
            continue  # vLLM 0.9.1 is recorded as vllm-ascend 0.9.1's pin only: no CUDA path
        for backend in backends:
            entry = data["attention_backends"][backend]
            if entry is None:
                continue  # a composite before 0.30
            for layout, tensor in sorted(entry["registered_tensor"].items()):
                if not isinstance(tensor, dict) or "stride_order" not in tensor:
                    continue  # default_layout, note
                for reader, kv_read in _readers(entry):
                    out.append(
                        Recorded(
                            data["version"],
                            backend,
                            entry["name"][0],
                            layout,
                            tensor,
                            kv_read,
                            reader,
                        )
                    )
    return out


def evaluate(symbols: list[str], geometry: Geometry) -> list[int]:
    """``["num_blocks", "2 * head_size"]`` -> numbers (the fixtures' dims are Python
    expressions over the ``get_kv_cache_shape`` parameters)."""
    return [int(eval(s, {"__builtins__": {}}, geometry.dims())) for s in symbols]


def inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for position, dim in enumerate(order):
        inv[dim] = position
    return inv


def build_cache(tensor: dict[str, Any], geometry: Geometry, device: str = "cpu") -> torch.Tensor:
    """The tensor ``register_kv_caches`` receives: the physical shape allocated (NaN), permuted
    to the logical shape."""
    logical = evaluate(tensor["logical_shape"], geometry)
    order = tensor["stride_order"]
    physical = [logical[d] for d in order]
    assert physical == evaluate(tensor["physical_shape"], geometry), "fixture inconsistent"
    memory = torch.full(physical, float("nan"), dtype=geometry.dtype, device=device)
    cache = memory.permute(*inverse(order))
    assert list(cache.shape) == logical
    return cache


def build_layer_of_shared_buffer(
    stride_order_lbhnc: list[int], geometry: Geometry, layers: int = 3, layer: int = 1
) -> torch.Tensor:
    """vLLM 0.29+: one layer's ``[NB, H, BS, 2D]`` view of a buffer shared by ``layers``
    layers, laid out in memory as a ``KVCacheLayout`` member's order over ``[L, B, H, N, C]``."""
    g = geometry
    logical = [layers, g.num_blocks, g.heads, g.block_size, 2 * g.head_dim]
    physical = [logical[d] for d in stride_order_lbhnc]
    memory = torch.full(physical, float("nan"), dtype=g.dtype)
    return memory.permute(*inverse(stride_order_lbhnc))[layer]


_PAIR_READ = re.compile(r"^(\w+), (\w+) = kv_cache\.(unbind\(\d\)|.*split\(self\.head_size.*)$")
_PERMUTE = re.compile(r"kv_cache\.permute\(\*stride_order\)$")


def backend_rows(
    recorded: Recorded,
    cache: torch.Tensor,
    head_dim: int,
    blocks: list[int] | torch.Tensor,
    offsets: list[int] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, D]`` K and V at ``(block, offset)`` pairs, read as the backend reads them.

    A ``k, v = kv_cache.unbind(i)`` or ``k, v = kv_cache....split(self.head_size, ...)`` line
    is evaluated and indexed ``[block, offset]``. FlashInfer before 0.26 has none: it hands
    ``kv_cache.permute(*stride_order)`` to FlashInfer, whose paged layout is
    ``[pages, 2, page_size, H, D]`` for NHD and ``[pages, 2, H, page_size, D]`` for HND.
    (Lines naming ``padded_hs`` or splitting by ``num_kv_heads`` read quantized caches.)
    The pairs are indexed as two index tensors, one gather per call.
    """
    scope = {
        "kv_cache": cache,
        "self": SimpleNamespace(head_size=head_dim),
        "stride_order": recorded.tensor["stride_order"],
    }
    b = torch.as_tensor(blocks, dtype=torch.long, device=cache.device)
    o = torch.as_tensor(offsets, dtype=torch.long, device=cache.device)
    for code in recorded.kv_read:
        match = _PAIR_READ.match(code)
        if match:
            exec(f"_k, _v = kv_cache.{match.group(3)}", {"__builtins__": {}}, scope)
            return scope["_k"][b, o], scope["_v"][b, o]
    for code in recorded.kv_read:
        if _PERMUTE.search(code):
            paged = eval("kv_cache.permute(*stride_order)", {"__builtins__": {}}, scope)
            if recorded.layout == "HND":
                # a slice between the two index tensors: the indexed dim comes first, [T, H, D]
                return paged[b, 0, :, o], paged[b, 1, :, o]
            return paged[b, 0, o], paged[b, 1, o]
    raise AssertionError(f"{recorded.id}: no kv_read line this test can evaluate")


def ascend_pair(data: dict[str, Any], geometry: Geometry) -> tuple | list:
    """vllm-ascend's per-layer cache: ``get_kv_cache_shape(...)[1:]`` each for K and V, two
    allocations, a list (0.9) or a tuple (0.11+), as ``kv_caches_stores`` records."""
    returns = data["attention_backend"]["get_kv_cache_shape"]["returns"]
    dims = next(r["dims"] for r in returns if r["when"] is None)
    assert dims[0] == "2"
    shape = evaluate(dims[1:], geometry)
    k = torch.full(shape, float("nan"), dtype=geometry.dtype)
    v = torch.full(shape, float("nan"), dtype=geometry.dtype)
    stores = [s["code"] for s in data["model_runner"]["kv_caches_stores"]]
    if "kv_caches[layer_name] = (k_cache, v_cache)" in stores:
        return (k, v)
    assert "kv_caches[layer_name] = kv_cache_list" in stores
    return [k, v]


def helper_rows(
    helper: dict[str, Any],
    cache: torch.Tensor,
    geometry: Geometry,
    blocks: list[int],
    offsets: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, D]`` K and V at ``(block, offset)`` pairs, read through a recorded helper such
    as vLLM 0.9.2-0.10.2's ``PagedAttention.split_kv_cache`` (a ``kv_read_helpers`` entry): its
    body is run on ``cache``; the K view it returns is ``[NB, H, D/x, BS, x]`` and the V view
    ``[NB, H, D, BS]``, the layout of vLLM's prefill/decode kernels."""
    scope: dict[str, Any] = {
        "kv_cache": cache,
        "num_kv_heads": geometry.heads,
        "head_size": geometry.head_dim,
    }
    body = "\n".join(helper["body"]).replace("return ", "_k, _v = ")
    exec(body, {"__builtins__": {}}, scope)
    k_cache, v_cache = scope["_k"], scope["_v"]
    nb, h, d = geometry.num_blocks, geometry.heads, geometry.head_dim
    assert k_cache.dim() == 5 and k_cache.shape[:3] == (nb, h, d // k_cache.shape[4])
    assert tuple(v_cache.shape) == (nb, h, d, geometry.block_size)
    b = torch.as_tensor(blocks, dtype=torch.long, device=cache.device)
    o = torch.as_tensor(offsets, dtype=torch.long, device=cache.device)
    # slices between the two index tensors: the indexed dim comes first, [T, H, D/x, x]
    return k_cache[b, :, :, o, :].reshape(len(b), h, d), v_cache[b, :, :, o]
