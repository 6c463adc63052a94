"""The blend's tiled CPU attention kernel (``backends/cpu/tiled_attention.cpp``), the CPU
backend's ``attention_at_positions``, against the torch reference, and how the connector picks it
(``selected_attention``).

The kernel runs only on x86-64 with AVX-512 BF16; elsewhere its numeric tests are skipped with
the reason and the connector keeps vLLM's attention (tested here with the loader failing).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmcache_backend.backends.cpu import tiled_attention as cpu_kernels
from lmcache_backend.config import ConfigError
from lmcache_backend.ops.reference import attention_at_positions

REASON = cpu_kernels.unsupported_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"tiled attention: {REASON}")

#: bf16 inputs, fp32 softmax and accumulation, probabilities and output rounded to bf16: the
#: output is within a few bf16 ulps of the fp32 reference of the same bf16 inputs (measured
#: at most 0.008 for outputs of magnitude ~1)
ATOL = RTOL = 2e-2


def _inputs(num_keys: int, positions: list[int], heads: int = 9, kv_heads: int = 3, dim: int = 64):
    g = torch.Generator().manual_seed(num_keys + len(positions))
    q = torch.randn(len(positions), heads, dim, generator=g).to(torch.bfloat16)
    # keys spread like a real layer's: some keys dominate a query's softmax
    k = (3 * torch.randn(num_keys, kv_heads, dim, generator=g)).to(torch.bfloat16)
    v = torch.randn(num_keys, kv_heads, dim, generator=g).to(torch.bfloat16)
    return q, torch.tensor(positions), k, v


def _reference(q, positions, k, v, scale):
    return attention_at_positions(q.float(), k.float(), v.float(), positions, scale)


@needs_kernel
@pytest.mark.parametrize(
    "num_keys, positions",
    [
        (1, [0]),  # one key
        (700, [0, 1, 2, 255, 256, 257, 511, 699]),  # block edges, T not a block multiple
        (300, list(range(0, 300, 3))),  # 100 queries: several tiles, each spanning gaps
        (1100, sorted({(i * 37) % 1100 for i in range(160)})),  # scattered, as a selection
        (640, list(range(600, 640))),  # one run of consecutive queries at the end
    ],
)
def test_tiled_attention_matches_the_reference(num_keys, positions) -> None:
    kernel = cpu_kernels.load_tiled_attention()
    q, pos, k, v = _inputs(num_keys, positions)
    out = kernel(q, pos, k, v, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), _reference(q, pos, k, v, 0.125), atol=ATOL, rtol=RTOL)


@needs_kernel
def test_tiled_attention_other_geometries() -> None:
    """Multi-head (no grouping) with head dim 128, and one KV head for 8 query heads."""
    kernel = cpu_kernels.load_tiled_attention()
    for heads, kv_heads, dim in ((4, 4, 128), (8, 1, 32)):
        q, pos, k, v = _inputs(520, [3, 64, 65, 300, 519], heads, kv_heads, dim)
        out = kernel(q, pos, k, v, dim**-0.5)
        expected = _reference(q, pos, k, v, dim**-0.5)
        torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=RTOL)


@needs_kernel
def test_tiled_attention_never_reads_a_later_key() -> None:
    """The mask is exact: keys and values after a query's position, changed, leave its
    output bit for bit the same, even where its tile holds later queries."""
    kernel = cpu_kernels.load_tiled_attention()
    positions = [5, 40, 41, 300, 301, 610]
    q, pos, k, v = _inputs(700, positions)
    before = kernel(q, pos, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[302:] = 50.0  # after every query but the last: it would dominate any softmax it entered
    v2[302:] = -7.0
    after = kernel(q, pos, k2, v2, 0.125)
    assert torch.equal(after[:5], before[:5])
    assert not torch.equal(after[5], before[5])  # the last query does read them


def _windowed_reference(q, positions, k, v, scale, window):
    return attention_at_positions(q.float(), k.float(), v.float(), positions, scale, window=window)


@needs_kernel
@pytest.mark.parametrize(
    "num_keys, positions, window",
    [
        (700, [0, 1, 2, 255, 256, 257, 511, 699], 512),  # a window across block edges
        (1100, sorted({(i * 37) % 1100 for i in range(160)}), 100),  # tiles wider than it
        (1300, list(range(0, 1300, 5)), 256),  # a window of exactly one block
        (600, [0, 7, 300, 599], 1),  # each query sees itself only
        (300, list(range(0, 300, 3)), 1000),  # a window longer than the prompt: causal
    ],
)
def test_tiled_attention_with_a_sliding_window_matches_the_reference(
    num_keys, positions, window
) -> None:
    kernel = cpu_kernels.load_tiled_attention()
    q, pos, k, v = _inputs(num_keys, positions)
    out = kernel(q, pos, k, v, 0.125, window)
    want = _windowed_reference(q, pos, k, v, 0.125, window)
    torch.testing.assert_close(out.float(), want, atol=ATOL, rtol=RTOL)


@needs_kernel
def test_tiled_attention_never_reads_a_key_before_the_window() -> None:
    """Keys before a query's window, changed, leave its output bit for bit the same; a query
    whose window holds them sees the change."""
    kernel = cpu_kernels.load_tiled_attention()
    q, pos, k, v = _inputs(900, [100, 400, 401, 650, 899])
    before = kernel(q, pos, k, v, 0.125, 300)
    k2, v2 = k.clone(), v.clone()
    k2[:250] = 50.0  # before the windows of the queries at 650 and 899 (keys 351.. and 600..)
    v2[:250] = -7.0
    after = kernel(q, pos, k2, v2, 0.125, 300)
    assert torch.equal(after[3:], before[3:])
    assert not torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])


@needs_kernel
def test_tiled_attention_rejects_bad_positions() -> None:
    kernel = cpu_kernels.load_tiled_attention()
    q, _, k, v = _inputs(10, [1, 2])
    with pytest.raises(RuntimeError, match="position 10 outside the 10 keys"):
        kernel(q, torch.tensor([1, 10]), k, v, 0.125)
    with pytest.raises(RuntimeError, match="positions must increase"):
        kernel(q, torch.tensor([2, 2]), k, v, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(q.float(), torch.tensor([1, 2]), k, v, 0.125)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        kernel(q, torch.tensor([1, 2]), k, v, 0.125, -3)


def test_unsupported_cpu_gets_a_reason(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx512f", "avx2"})
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    reason = cpu_kernels.unsupported_reason()
    assert reason is not None and "avx512bw" in reason and "avx512_bf16" in reason
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert "x86-64" in cpu_kernels.unsupported_reason()


def _model(head_dim: int = 64, dtype=torch.bfloat16):
    """What ``attention_choice._tiled_attention`` reads of the model."""
    return SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)


def _cpu_ops(kernel):
    """The CPU backend's op set with ``kernel`` as its ``attention_at_positions`` (and the real
    verifier), without building anything."""
    from dataclasses import replace

    from lmcache_backend.ops import get_ops

    return replace(
        get_ops("torch"),
        name="cpu",
        attention_at_positions=kernel,
        served_by=(("attention_at_positions", "cpu"),),
        verifiers={"attention_at_positions": cpu_kernels.verify_attention_at_positions},
    )


def test_selected_attention_choice(caplog) -> None:
    """``auto`` falls back to vLLM's attention with a warning saying why; ``tiled`` stops the
    engine with an error naming the key; ``vllm`` never uses the kernel. The kernel is the op
    registry's ``attention_at_positions``, taken where the CPU backend serves it and its
    verifier accepts the model's queries."""
    pytest.importorskip("vllm")
    from dataclasses import replace

    from lmcache_backend.integration.vllm.worker_side.attention_choice import (
        _tiled_attention as pick,
    )
    from lmcache_backend.ops import get_ops

    no_kernel = replace(
        get_ops("torch"),
        fallback_reason="cpu backend: tiled attention needs the CPU flags avx512_bf16",
    )
    bf16 = torch.bfloat16
    with caplog.at_level(logging.WARNING):
        assert pick("auto", bf16, _model(), no_kernel) is None
    assert "selected_attention=auto" in caplog.text and "avx512_bf16" in caplog.text
    with pytest.raises(ConfigError, match="selected_attention='tiled'.*avx512_bf16"):
        pick("tiled", bf16, _model(), no_kernel)
    sentinel = object()
    ops = _cpu_ops(sentinel)
    with pytest.raises(ConfigError, match="bf16 KV cache"):
        pick("tiled", torch.float32, _model(), ops)
    with pytest.raises(ConfigError, match="bf16 q/k/v, got torch.float16"):
        pick("tiled", bf16, _model(dtype=torch.float16), ops)
    with pytest.raises(ConfigError, match="head dim multiple of 32.*80"):
        pick("tiled", bf16, _model(head_dim=80), ops)
    assert pick("vllm", bf16, _model(), ops) is None
    assert pick("auto", bf16, _model(), ops) is sentinel
    assert pick("tiled", bf16, _model(), ops) is sentinel


def test_op_set_is_loaded_when_the_caches_are_registered(monkeypatch) -> None:
    """The op set (the CPU backend builds its kernel then) is loaded at engine start, not in the
    first blended request's TTFT, and the caches are ordered by layer index."""
    pytest.importorskip("vllm")
    from lmcache_backend.integration.vllm.worker_side import worker as worker_module

    calls = []
    monkeypatch.setattr(worker_module, "get_ops", lambda name: calls.append(name))
    side = SimpleNamespace(
        settings=SimpleNamespace(config=SimpleNamespace(backend="auto"), tp_size=1),
        profile=SimpleNamespace(kv_transfer_after_model_load=False),
    )
    side._ops = lambda: worker_module.WorkerSide._ops(side)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(1) for i in (1, 0)}
    worker_module.WorkerSide.register_kv_caches(side, caches)
    assert calls == ["auto"]
    assert side.layer_names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_cpu_backend_serves_attention_at_positions_with_the_kernel() -> None:
    """``get_ops("cpu")``: the tiled kernel is ``attention_at_positions``, equal to the reference
    within bf16 rounding; a call it cannot serve (fp32) goes to the reference."""
    if REASON is not None:
        pytest.skip(REASON)
    from lmcache_backend.ops import get_ops
    from lmcache_backend.ops.reference import attention_at_positions

    ops = get_ops("cpu")
    assert ops.native("attention_at_positions") and not ops.native("rope_rerotate_k")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 64, generator=g)
    k, v = (torch.randn(40, 2, 64, generator=g) for _ in range(2))
    positions = torch.tensor([3, 10, 11, 30, 39])
    want = attention_at_positions(q, k, v, positions, 0.125)
    got = ops.attention_at_positions(q.bfloat16(), k.bfloat16(), v.bfloat16(), positions, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert ops.decline_reason("attention_at_positions", q, k, v, positions, 0.125)
    torch.testing.assert_close(ops.attention_at_positions(q, k, v, positions, 0.125), want)
    # a sliding window is served by the kernel too (Gemma 3's local layers); a bad one is not
    bq, bk, bv = q.bfloat16(), k.bfloat16(), v.bfloat16()
    args = (bq, bk, bv, positions, 0.125)
    assert ops.decline_reason("attention_at_positions", *args, window=8) is None
    windowed = attention_at_positions(q, k, v, positions, 0.125, window=8)
    got = ops.attention_at_positions(*args, window=8)
    torch.testing.assert_close(got.float(), windowed, atol=2e-2, rtol=2e-2)
    assert "window" in ops.decline_reason("attention_at_positions", *args, window=0)


def test_a_build_shares_no_lock_and_moves_its_library_in_one_step(tmp_path, monkeypatch) -> None:
    """Each process compiles in a folder of its own and moves the library into the cache: a
    build killed midway leaves nothing another process waits on (torch's loader waits on its
    ``lock`` file without a time limit), and a failed build leaves no library behind."""
    from torch.utils import cpp_extension

    seen: list[Path] = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        build = Path(build_directory)
        seen.append(build)
        assert build.parent == tmp_path and not (tmp_path / "lock").exists()
        (build / "lock").write_text("")  # what torch's loader leaves while it builds
        (build / f"{name}.so").write_bytes(b"library")
        return SimpleNamespace(tiled_attention=None)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    library = tmp_path / "lmcache_tiled_attention_x.so"
    cpu_kernels._build("lmcache_tiled_attention_x", library)
    assert library.read_bytes() == b"library"
    assert sorted(p.name for p in tmp_path.iterdir()) == [library.name]  # its folder is gone

    def failing_load(**kwargs):
        raise RuntimeError("Error building extension")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    with pytest.raises(RuntimeError):
        cpu_kernels._build("lmcache_tiled_attention_y", tmp_path / "lmcache_tiled_attention_y.so")
    assert sorted(p.name for p in tmp_path.iterdir()) == [library.name]


@needs_kernel
def test_a_built_library_is_imported_without_compiling(tmp_path, monkeypatch) -> None:
    """A library already in the cache is imported as it is; the compiler is not called."""
    import shutil

    from torch.utils import cpp_extension

    cpu_kernels.load_tiled_attention()  # the suite's own cache holds it after this
    built = next(cpu_kernels._cache_dir().glob("lmcache_tiled_attention_*.so"))
    shutil.copy(built, tmp_path / built.name)
    monkeypatch.setenv("LMCACHE_KERNEL_CACHE", str(tmp_path))

    def no_compiler(**kwargs):
        raise AssertionError("compiled although the library was cached")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    cpu_kernels.load_tiled_attention.cache_clear()
    try:
        q, positions, k, v = _inputs(64, [5, 40, 63])
        got = cpu_kernels.load_tiled_attention()(q, positions, k, v, 0.125)
        torch.testing.assert_close(
            got.float(), _reference(q, positions, k, v, 0.125), atol=ATOL, rtol=RTOL
        )
    finally:
        cpu_kernels.load_tiled_attention.cache_clear()
