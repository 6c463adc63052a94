"""Contract tests: for every KV cache form a released vLLM wheel (0.9.2-0.33.0, FLASH_ATTN,
FLASHINFER, TRITON_ATTN, each recorded layout; from 0.30 the composites TRITON_FLASH_ATTN and
TRITON_FLASHINFER, read as each of their two children reads) or vllm-ascend release hands a
connector, the layout :func:`layout_for` picks writes K/V rows exactly where that backend reads
them; a recorded read in another element order (0.9.2-0.10.2 TRITON_ATTN under
``VLLM_V1_USE_PREFILL_DECODE_ATTENTION``) is refused when its variable is set.

The caches are tensors shaped and strided as recorded from the released packages
(``tests/fixtures/engine_contracts``, see ``engine_cache_forms.py``), NaN-filled. Rows are written
through the layout, then read back with the fixture's own ``kv_read`` code and through the
layout; every element not written must still be NaN. Writes go through the torch reference (CPU
tensors) and the Triton kernels (on :data:`conftest.DEVICE`: compiled on the GPU when one is
visible, else the interpreter on CPU tensors); vllm-ascend pairs also through the Ascend backend
with its torch_npu operators emulated on CPU tensors. This shows the layouts agree with the
recorded forms; only the Triton case is a run on a GPU, and none is a run on an NPU.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import npu_emulation
import pytest
import torch
from engine_cache_forms import (
    COMPOSITE_BACKENDS,
    CUDA_BACKENDS,
    GEOMETRIES,
    Geometry,
    Recorded,
    ascend_pair,
    backend_rows,
    build_cache,
    build_layer_of_shared_buffer,
    helper_rows,
    load,
    recorded_tensors,
    version_key,
)
from numerics import DEVICE

from lmcache_backend.integration.vllm.layouts import (
    DeviceLayout,
    UnsupportedKVCache,
    layout_for,
    slots_for,
)
from lmcache_backend.integration.vllm.layouts.device import CacheForm
from lmcache_backend.ops import get_ops, implementations

RECORDED = recorded_tensors(composites=True)
ASCEND = load("vllm-ascend")
# (release, member, stride order over [L, B, H, N, C]) of every 0.29+ KVCacheLayout member
SHARED_BUFFER_LAYOUTS = [
    (data["version"], name, member["stride_order_LBHNC"])
    for data in load("vllm")
    if "enum" in data["kv_cache_layout"]
    for name, member in sorted(data["kv_cache_layout"]["enum"]["members"].items())
]

ReadFn = Callable[[torch.Tensor, list[int], list[int]], tuple[torch.Tensor, torch.Tensor]]


def _ops(name: str):
    if name == "torch":
        return get_ops("torch")
    # Triton: compiled on a GPU (the caches are put on DEVICE), the interpreter on CPU (conftest)
    ops = get_ops("cuda")
    verify_write, verify_read = (ops.verifiers[op] for op in ("paged_kv_write", "paged_kv_read"))

    def write(key, value, k_cache, v_cache, slots):
        # a declined call would go to the reference and pass for the wrong reason
        assert verify_write(key, value, k_cache, v_cache, slots) is None, "kernel declined"
        ops.paged_kv_write(key, value, k_cache, v_cache, slots)

    def read(k_cache, v_cache, slots):
        assert verify_read(k_cache, v_cache, slots) is None, "kernel declined"
        return ops.paged_kv_read(k_cache, v_cache, slots)

    return SimpleNamespace(name="cuda", paged_kv_write=write, paged_kv_read=read)


def contract_problems(
    layout: DeviceLayout,
    cache,
    geometry: Geometry,
    backend_read: ReadFn,
    scheduler_block_size: int | None = None,
    memory: list[torch.Tensor] | None = None,
) -> list[str]:
    """Write rows of three scheduler blocks through ``layout``; what differs from the backend's
    view. ``backend_read(cache, kernel_blocks, rows)``: ``[T, H, D]`` K and V where the backend
    reads token ``t`` (kernel block ``b * r + o // BS``, row ``o % BS`` for offset ``o`` of
    scheduler block ``b``, ``r`` kernel blocks per scheduler block, as vLLM's block table maps
    them). ``memory``: every tensor the cache lives in (default: the cache's tensors)."""
    g = geometry
    sched = scheduler_block_size or g.block_size
    per_block = sched // g.block_size
    num_sched_blocks = g.num_blocks // per_block
    block_ids = [num_sched_blocks - 1, 0, num_sched_blocks - 2]
    num_tokens = 2 * sched + sched // 2
    gen = torch.Generator().manual_seed(num_tokens)
    shape = (num_tokens, g.heads, g.head_dim)
    device = (cache[0] if isinstance(cache, (tuple, list)) else cache).device
    keys = torch.randn(shape, generator=gen).to(device, g.dtype)
    values = torch.randn(shape, generator=gen).to(device, g.dtype)
    slots = slots_for(block_ids, sched, 0, num_tokens)
    layout.write(cache, keys, values, slots)

    kernel_blocks, rows = [], []
    for pos in range(num_tokens):
        offset = pos % sched
        kernel_blocks.append(block_ids[pos // sched] * per_block + offset // g.block_size)
        rows.append(offset % g.block_size)
    problems = []
    got_k, got_v = backend_read(cache, kernel_blocks, rows)
    if not torch.equal(got_k, keys):
        problems.append("the backend reads other keys than were written")
    if not torch.equal(got_v, values):
        problems.append("the backend reads other values than were written")
    read_k, read_v = layout.read(cache, slots)
    if not (torch.equal(read_k, keys) and torch.equal(read_v, values)):
        problems.append("the layout reads back other rows than it wrote")
    tensors = (
        memory
        if memory is not None
        else (list(cache) if isinstance(cache, (tuple, list)) else [cache])
    )
    written = sum(int((~t.isnan()).sum()) for t in tensors)
    if written != 2 * keys.numel():
        problems.append(f"{written} elements written, expected {2 * keys.numel()}")
    return problems


def _recorded_read(recorded: Recorded, geometry: Geometry) -> ReadFn:
    def read(cache, blocks, rows):
        return backend_rows(recorded, cache, geometry.head_dim, blocks, rows)

    return read


def _pair_read(cache, blocks, rows):
    # vllm-ascend: slot s is row s % BS of block s // BS of each [NB, BS, H, D] cache
    k_cache, v_cache = cache
    b, r = torch.tensor(blocks), torch.tensor(rows)
    return k_cache[b, r], v_cache[b, r]


def _layout(cache, geometry: Geometry, ops, backend: str | None, block_size: int | None = None):
    return layout_for(
        cache,
        num_kv_heads=geometry.heads,
        head_dim=geometry.head_dim,
        block_size=block_size or geometry.block_size,
        backend_name=backend,
        ops=ops,
    )


# ------------------------------------------------------------------- vLLM, every recorded form


@pytest.mark.parametrize("ops_name", ["torch", "cuda"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("recorded", RECORDED, ids=[r.id for r in RECORDED])
def test_vllm_form(recorded: Recorded, geometry: Geometry, ops_name: str) -> None:
    # the kernels on DEVICE; the torch reference is checked on the CPU, as in every other test here
    cache = build_cache(recorded.tensor, geometry, DEVICE if ops_name == "cuda" else "cpu")
    layout = _layout(cache, geometry, _ops(ops_name), recorded.name)
    assert contract_problems(layout, cache, geometry, _recorded_read(recorded, geometry)) == []


def test_every_release_and_backend_is_covered() -> None:
    releases = {r.version for r in RECORDED}
    assert len(releases) == 27 and min(releases, key=version_key) == "0.9.2"
    assert max(releases, key=version_key) == "0.33.0"
    for version in releases:
        for backend in CUDA_BACKENDS:
            layouts = {r.layout for r in RECORDED if (r.version, r.backend) == (version, backend)}
            assert layouts in ({"NHD", "HND"}, {"LBNHC", "LBHNC"}), (version, backend, layouts)
    # the composites exist from 0.30 (none in 0.29); each is read as both its children read
    composites = {(r.version, r.backend, r.reader, r.layout) for r in RECORDED if r.reader}
    children = {"TRITON_FLASH_ATTN": "FLASH_ATTN", "TRITON_FLASHINFER": "FLASHINFER"}
    assert composites == {
        (version, name, reader, layout)
        for version in ("0.30.0", "0.31.0", "0.32.0", "0.33.0")
        for name in COMPOSITE_BACKENDS
        for reader in ("TRITON_ATTN", children[name])
        for layout in ("LBNHC", "LBHNC")
    }


COMPOSITES = [
    (data["version"], name, data["attention_backends"])
    for data in load("vllm")
    for name in COMPOSITE_BACKENDS
    if data["attention_backends"][name] is not None
]


@pytest.mark.parametrize(
    ("version", "name", "backends"), COMPOSITES, ids=[f"{v}-{n}" for v, n, _ in COMPOSITES]
)
def test_a_composite_backend_hands_over_its_childrens_cache(version, name, backends) -> None:
    """What makes a composite's cache a recorded form: the generated backend defines no cache
    shape of its own, its children's per-layer views are the same, the implementation hands
    ``kv_cache`` unchanged to the child it picks and writes through the general child."""
    entry = backends[name]
    composite, factory = entry["composite"], entry["composite"]["factory"]
    assert entry["name"] == [name] and factory["get_name"] == ["return backend_name"]
    assert factory["defines"] == []  # no get_kv_cache_shape / get_kv_cache_stride_order
    assert "raise ValueError('Composite backends require the same KV cache spec')" in (
        "\n".join(factory["customize_spec"])
    )
    for child in (composite["general"]["backend"], composite["causal"]["backend"]):
        for layout in ("LBNHC", "LBHNC"):
            assert (
                backends[child]["registered_tensor"][layout] == entry["registered_tensor"][layout]
            )
    for call in factory["impl_forward_passes_kv_cache"]:
        assert "kv_cache" in [ast.unparse(a) for a in ast.parse(call, mode="eval").body.args]
    assert factory["impl_do_kv_cache_update"][0] == "method = self.general_impl.do_kv_cache_update"
    # picked on CUDA for models with bidirectional image prefixes only
    assert all("use_mm_prefix" in " ".join(s["when"]) for s in composite["selected"])


@pytest.mark.parametrize(
    ("version", "member", "order"),
    SHARED_BUFFER_LAYOUTS,
    ids=[f"{v}-{m}" for v, m, _ in SHARED_BUFFER_LAYOUTS],
)
def test_vllm_layer_of_a_shared_buffer(version: str, member: str, order: list[int]) -> None:
    """0.29+: a layer's view of one buffer holding 3 layers, in every ``KVCacheLayout`` order
    (block-outer orders put other layers' pages between a layer's blocks)."""
    recorded = next(r for r in RECORDED if (r.version, r.backend) == (version, "FLASH_ATTN"))
    geometry = GEOMETRIES["bf16-H8-D128"]
    cache = build_layer_of_shared_buffer(order, geometry)
    layout = _layout(cache, geometry, get_ops("torch"), "FLASH_ATTN")
    read = _recorded_read(recorded, geometry)
    assert contract_problems(layout, cache, geometry, read, memory=[cache._base]) == []


# ----------------------------------------------------------------------------- vllm-ascend


@pytest.fixture
def ascend_ops() -> Iterator[SimpleNamespace]:
    """The Ascend backend's ops with torch_npu replaced by the emulation (``npu_emulation``)."""
    import lmcache_backend.backends.ascend  # noqa: F401 - importing it registers its ops
    from lmcache_backend.backends.ascend import _npu

    npu_emulation.CALLS.clear()
    with _npu.use_npu_module(npu_emulation):
        yield SimpleNamespace(**implementations("ascend"))


@pytest.mark.parametrize("ops_name", ["torch", "ascend-emulated"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("data", ASCEND, ids=[d["version"] for d in ASCEND])
def test_vllm_ascend_pair(data, geometry: Geometry, ops_name: str, request) -> None:
    cache = ascend_pair(data, geometry)
    ops = get_ops("torch") if ops_name == "torch" else request.getfixturevalue("ascend_ops")
    names = data["attention_backend"]["name"]
    backend = "CUSTOM" if "CUSTOM" in names[0] else names[0]
    layout = _layout(cache, geometry, ops, backend)
    assert contract_problems(layout, cache, geometry, _pair_read) == []
    if ops_name != "torch":
        assert sum(npu_emulation.CALLS.values()) >= 1  # the NPU path ran, not the reference


# ----------------------------------------------------------------------------- kernel blocks


def _kernel_block_cases() -> list[Recorded]:
    """One recorded tensor per distinct (logical shape, stride order)."""
    seen, out = set(), []
    for r in RECORDED:
        key = (tuple(r.tensor["logical_shape"]), tuple(r.tensor["stride_order"]))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


@pytest.mark.parametrize("recorded", _kernel_block_cases(), ids=lambda r: r.id)
def test_kernel_blocks_inside_scheduler_blocks(recorded: Recorded) -> None:
    """From 0.11.2 the cache may count kernel blocks of 16 tokens inside 32-token scheduler
    blocks: the scheduler's slots must land where the backend reads through its kernel blocks."""
    geometry = GEOMETRIES["bf16-H8-D128"]
    cache = build_cache(recorded.tensor, geometry)
    layout = _layout(cache, geometry, get_ops("torch"), recorded.name, block_size=32)
    assert layout.kernel_block_size == 16 and layout.block_size == 32
    read = _recorded_read(recorded, geometry)
    assert contract_problems(layout, cache, geometry, read, scheduler_block_size=32) == []


def test_kernel_blocks_of_an_ascend_pair() -> None:
    geometry = GEOMETRIES["bf16-H8-D128"]
    cache = ascend_pair(ASCEND[-1], geometry)
    layout = _layout(cache, geometry, get_ops("torch"), "CUSTOM", block_size=32)
    assert contract_problems(layout, cache, geometry, _pair_read, scheduler_block_size=32) == []


# ------------------------------------------------------- a wrong reading is caught (negative)


def _misread(form: CacheForm, swap: Callable) -> CacheForm:
    return CacheForm(f"misread {form.name}", form.shape, lambda c, d: swap(*form.views(c, d)))


def _as_other_order(k: torch.Tensor, v: torch.Tensor):
    """The same memory read in the other order inside a block: NHD as HND, HND as NHD."""

    def swap(t: torch.Tensor) -> torch.Tensor:
        nb, bs, h, d = t.shape
        block, slot, head, dim = t.stride()
        if slot > head:  # NHD: a token's heads together -> read a head's tokens together
            slot, head = head, head * bs
        else:
            head, slot = slot, slot * h
        return t.as_strided((nb, bs, h, d), (block, slot, head, dim))

    return swap(k), swap(v)


MISREADINGS = {
    "K and V exchanged": lambda k, v: (v, k),
    "NHD read as HND": _as_other_order,
}
WRONG_CASES = [
    ("0.24.0", "FLASH_ATTN", "NHD"),
    ("0.24.0", "FLASHINFER", "HND"),
    ("0.30.0", "FLASH_ATTN", "LBNHC"),
    ("0.30.0", "FLASHINFER", "LBHNC"),
    ("0.9.2", "FLASH_ATTN", "HND"),
]


@pytest.mark.parametrize("misreading", MISREADINGS, ids=MISREADINGS.keys())
@pytest.mark.parametrize("case", WRONG_CASES, ids=["-".join(c) for c in WRONG_CASES])
def test_a_wrong_reading_fails_the_contract(case: tuple[str, str, str], misreading: str) -> None:
    """The check that passes above must fail for a layout that reads the cache the wrong way."""
    recorded = next(r for r in RECORDED if (r.version, r.backend, r.layout) == case)
    geometry = GEOMETRIES["fp32-tiny"]
    cache = build_cache(recorded.tensor, geometry)
    right = _layout(cache, geometry, get_ops("torch"), recorded.name)
    wrong = DeviceLayout(
        _misread(right.form, MISREADINGS[misreading]),
        geometry.head_dim,
        geometry.block_size,
        geometry.block_size,
        get_ops("torch"),
    )
    read = _recorded_read(recorded, geometry)
    problems = contract_problems(wrong, cache, geometry, read)
    assert any("the backend reads other" in p for p in problems), problems


def test_scheduler_blocks_taken_for_cache_blocks_fail_the_contract() -> None:
    """Slots in 32-token scheduler blocks written as if the cache had 32-token blocks."""
    case = ("0.33.0", "FLASH_ATTN", "LBHNC")
    recorded = next(r for r in RECORDED if (r.version, r.backend, r.layout) == case)
    geometry = GEOMETRIES["bf16-H8-D128"]
    cache = build_cache(recorded.tensor, geometry)
    right = _layout(cache, geometry, get_ops("torch"), "FLASH_ATTN", block_size=32)

    def merged(k: torch.Tensor, v: torch.Tensor):
        # two 16-token kernel blocks seen as one 32-token block: in HND memory a block is
        # [H, BS, D], so row 16 of the merged block is not row 0 of the next kernel block
        return tuple(
            t.as_strided((t.shape[0] // 2, 32, *t.shape[2:]), (t.stride(0) * 2, *t.stride()[1:]))
            for t in (k, v)
        )

    wrong = DeviceLayout(_misread(right.form, merged), 128, 32, 32, get_ops("torch"))
    read = _recorded_read(recorded, geometry)
    problems = contract_problems(wrong, cache, geometry, read, scheduler_block_size=32)
    assert problems, "reading kernel blocks as scheduler blocks went unnoticed"


# ------------------------------------- a read in another element order, chosen by a variable

SWITCHED = [
    (data["version"], backend, helper, switch["env"])
    for data in load("vllm")
    if version_key(data["version"]) >= (0, 9, 2)
    for backend in CUDA_BACKENDS
    for helper in data["attention_backends"][backend]["kv_read_helpers"]
    for switch in helper["switches"]
]
SWITCH_IDS = [f"{v}-{b}" for v, b, _, _ in SWITCHED]


def test_which_releases_read_in_another_order_under_a_variable() -> None:
    """vLLM 0.9.2-0.10.2 TRITON_ATTN only (from 0.11 the variable moved to ROCm's backend)."""
    assert [(v, b, env) for v, b, _, env in SWITCHED] == [
        (v, "TRITON_ATTN", "VLLM_V1_USE_PREFILL_DECODE_ATTENTION")
        for v in ("0.9.2", "0.10.0", "0.10.2")
    ]
    for _, _, helper, _ in SWITCHED:
        assert helper["helper"]["source"].endswith("::PagedAttention.split_kv_cache")


@pytest.mark.parametrize(("version", "backend", "helper", "env"), SWITCHED, ids=SWITCH_IDS)
def test_the_switched_read_is_another_element_order(version, backend, helper, env) -> None:
    """Rows written where the default read finds them are not where ``split_kv_cache`` reads:
    serving that read with the same layout would be a silent wrong answer."""
    recorded = next(
        r for r in RECORDED if (r.version, r.backend, r.layout) == (version, backend, "NHD")
    )
    geometry = GEOMETRIES["bf16-H8-D128"]
    cache = build_cache(recorded.tensor, geometry)
    layout = _layout(cache, geometry, get_ops("torch"), recorded.name)

    def switched_read(cache, blocks, rows):
        return helper_rows(helper["helper"], cache, geometry, blocks, rows)

    problems = contract_problems(layout, cache, geometry, switched_read)
    assert "the backend reads other keys than were written" in problems
    assert "the backend reads other values than were written" in problems


@pytest.mark.parametrize("value", ["1", "true", "True"])
@pytest.mark.parametrize(("version", "backend", "helper", "env"), SWITCHED, ids=SWITCH_IDS)
def test_a_switched_read_is_refused_at_start(
    version, backend, helper, env, value, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = next(
        r for r in RECORDED if (r.version, r.backend, r.layout) == (version, backend, "NHD")
    )
    geometry = GEOMETRIES["fp32-tiny"]
    cache = build_cache(recorded.tensor, geometry)
    monkeypatch.setenv(env, value)
    for name in (recorded.name, None):  # a backend not named might be this one
        with pytest.raises(UnsupportedKVCache) as info:
            _layout(cache, geometry, get_ops("torch"), name)
        message = str(info.value)
        assert f"{env}={value}" in message and f"unset {env}" in message and "\n" not in message
    # FLASH_ATTN reads the same form without looking at the variable
    assert _layout(cache, geometry, get_ops("torch"), "FLASH_ATTN").memory == "NHD"
    monkeypatch.setenv(env, "0")
    assert _layout(cache, geometry, get_ops("torch"), recorded.name).memory == "NHD"


@pytest.mark.parametrize(("version", "backend", "helper", "env"), SWITCHED, ids=SWITCH_IDS)
def test_the_variable_is_read_as_vllm_reads_it(version, backend, helper, env, monkeypatch) -> None:
    """``env_flag`` against the release's own ``vllm/envs.py`` expression, evaluated."""
    from lmcache_backend.integration.vllm.layouts.choice import env_flag

    (switch,) = helper["switches"]
    for value in ["1", "true", "TRUE", "True", "0", "false", "yes", "on", "", " 1", None]:
        environ = {} if value is None else {env: value}
        stub = SimpleNamespace(getenv=lambda name, default=None, e=environ: e.get(name, default))
        expected = eval(switch["reads"], {"__builtins__": {}}, {"os": stub})
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        assert (env_flag(env) is not None) == expected, value
