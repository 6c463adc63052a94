"""Benchmark the CUDA backend's Triton kernels on a GPU.

Measures, with CUDA events, the median time of:

- the device copy bandwidth (``dst.copy_(src)``, 1 GiB), the yardstick for the memory-bound ops;
- RoPE re-rotation of K in place, row gather and row scatter: achieved bandwidth as a fraction of
  the copy bandwidth (target >= 80%), next to torch's own ops for the same work;
- selected-query attention (8k and 32k keys, 15% of them as queries, exact per-position mask)
  against torch SDPA given the explicit ``[Nq, Nk]`` mask (target >= 3x faster);
- the same attention read from a paged cache through a shuffled block table
  (``paged_attention_at_positions``, the blend's path inside vLLM) against the contiguous kernel,
  and against gathering the blocks into contiguous K/V first (target: faster than the gather).

Each kernel's output is first checked against the torch reference ops (relative error column).
Times are the GPU's (:func:`median_ms`): the host's launch cost is outside the interval, for the
kernels and the torch baselines alike.

Usage::

    python benchmarks/kernels.py            # default sizes (about 3 GiB of GPU memory)
    python benchmarks/kernels.py --reps 100 --tokens 131072

Exits with status 2 and a message when no CUDA GPU is visible. ``lmcache-backend hardware-check``
imports this file and calls :func:`parse_args`, :func:`unavailable_reason` and :func:`run`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

BANDWIDTH_TARGET = 0.80
ATTENTION_SPEEDUP_TARGET = 3.0
#: the paged kernel must beat gathering the blocks into contiguous K/V and running the kernel
PAGED_SPEEDUP_TARGET = 1.0
#: block size of the paged cache (vLLM's default on CUDA)
PAGED_BLOCK_SIZE = 16


@dataclass
class Row:
    case: str
    shape: str
    kernel_ms: float
    baseline: str
    baseline_ms: float
    metric: str
    target: str
    ok: bool | None
    rel_err: float


#: GPU cycles the stream spins before each timed call (~0.1 ms on a 2 GHz GPU): longer than the
#: host takes to launch a kernel, so the timed interval holds the GPU's work only
_SPIN_CYCLES = 200_000


def median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median GPU time of ``fn`` on the current stream, in milliseconds.

    Before each call the stream spins (``torch.cuda._sleep``) while the host launches ``fn``
    behind it, so the interval between the two events is the device's work alone: the host's
    launch cost (a Python launcher for Triton, C++ for torch's ops) is not counted for either
    side, as it is not when kernels queue behind each other in a model's forward pass.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def copy_bandwidth(warmup: int, reps: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup, reps)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def cos_sin_cache(max_pos: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (
        torch.arange(0, rot_dim, 2, dtype=torch.float64, device="cuda") / rot_dim
    )
    angles = torch.arange(max_pos, dtype=torch.float64, device="cuda")[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def bench_rope(args, copy_bw: float) -> Row:
    from lmcache_backend.backends.cuda.rope import rope_rerotate_k
    from lmcache_backend.ops.reference import rope_rerotate_k as reference

    tokens, heads, head_dim = args.tokens, args.kv_heads, args.head_dim
    k = torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    # A chunk moved 4096 positions later: old and new positions are contiguous ranges.
    old = torch.arange(tokens, device="cuda")
    new = old + 4096
    table = cos_sin_cache(tokens + 4096, head_dim)
    expected = reference(k.clone(), old, new, table, True)
    check = k.clone()
    rope_rerotate_k(check, old, new, table, True)
    err = relative_error(check, expected)

    ms = median_ms(lambda: rope_rerotate_k(k, old, new, table, True), args.warmup, args.reps)
    ref_ms = median_ms(lambda: reference(k, old, new, table, True), args.warmup, args.reps)
    # Minimal traffic: K read and written, two table rows and two positions per token.
    nbytes = 2 * k.numel() * k.element_size() + tokens * (2 * head_dim * 4 + 2 * 8)
    fraction = nbytes / (ms * 1e-3) / copy_bw
    return Row(
        "rope_rerotate_k (neox, bf16)",
        f"T={tokens} Hkv={heads} D={head_dim}",
        ms,
        "torch reference",
        ref_ms,
        f"{fraction:.0%} of copy BW",
        f">= {BANDWIDTH_TARGET:.0%}",
        fraction >= BANDWIDTH_TARGET,
        err,
    )


def bench_rows(args, copy_bw: float) -> list[Row]:
    from lmcache_backend.backends.cuda.rows import gather_rows, scatter_rows

    tokens, width = args.tokens, args.kv_heads * args.head_dim
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    # Half the rows, sorted, as the blender's index sets are.
    idx = torch.randperm(tokens, device="cuda")[: tokens // 2].sort().values
    src = torch.randn(idx.numel(), width, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * idx.numel() * width * x.element_size() + idx.numel() * 8

    gather_err = relative_error(gather_rows(x, idx), x.index_select(0, idx))
    gather_ms = median_ms(lambda: gather_rows(x, idx), args.warmup, args.reps)
    torch_gather_ms = median_ms(lambda: x.index_select(0, idx), args.warmup, args.reps)

    expected = x.clone().index_copy_(0, idx, src)
    scatter_err = relative_error(scatter_rows(x.clone(), idx, src), expected)
    scatter_ms = median_ms(lambda: scatter_rows(x, idx, src), args.warmup, args.reps)
    torch_scatter_ms = median_ms(lambda: x.index_copy_(0, idx, src), args.warmup, args.reps)

    rows = []
    for name, ms, base, base_ms, err in (
        ("gather_rows (bf16)", gather_ms, "torch index_select", torch_gather_ms, gather_err),
        ("scatter_rows (bf16)", scatter_ms, "torch index_copy_", torch_scatter_ms, scatter_err),
    ):
        fraction = nbytes / (ms * 1e-3) / copy_bw
        rows.append(
            Row(
                name,
                f"T={tokens} N={idx.numel()} F={width}",
                ms,
                base,
                base_ms,
                f"{fraction:.0%} of copy BW",
                f">= {BANDWIDTH_TARGET:.0%}",
                fraction >= BANDWIDTH_TARGET,
                err,
            )
        )
    return rows


def bench_attention(args) -> list[Row]:
    return [row for num_k in args.keys for row in _bench_attention(args, num_k)]


def _bench_attention(args, num_k: int) -> list[Row]:
    import torch.nn.functional as F

    from lmcache_backend.backends.cuda.attention import attention_at_positions
    from lmcache_backend.ops.reference import attention_at_positions as reference

    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    num_q = int(num_k * args.query_ratio)
    dtype = torch.bfloat16
    q = torch.randn(num_q, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(num_k, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(num_k, hkv, d, device="cuda", dtype=dtype)
    positions = torch.randperm(num_k - 1, device="cuda")[: num_q - 1].sort().values
    positions = torch.cat([positions, torch.tensor([num_k - 1], device="cuda")])
    scale = d**-0.5
    err = relative_error(
        attention_at_positions(q, k, v, positions, scale), reference(q, k, v, positions, scale)
    )
    kernel_ms = median_ms(
        lambda: attention_at_positions(q, k, v, positions, scale), args.warmup, args.reps
    )

    # SDPA's best case: mask built once, K/V already expanded to the query heads so the
    # memory-efficient kernel (which takes an arbitrary mask) can run; neither is timed.
    mask = torch.arange(num_k, device="cuda")[None, :] <= positions[:, None]
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).unsqueeze(0)
    v4 = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).unsqueeze(0)
    mask4 = mask[None, None]
    sdpa_ms = median_ms(
        lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask4, scale=scale),
        args.warmup,
        args.reps,
    )
    speedup = sdpa_ms / kernel_ms
    shape = f"Nk={num_k} Nq={num_q} Hq={hq} Hkv={hkv} D={d}"
    rows = [
        Row(
            "attention_at_positions (bf16)",
            shape,
            kernel_ms,
            "torch SDPA + explicit mask",
            sdpa_ms,
            f"{speedup:.1f}x faster",
            f">= {ATTENTION_SPEEDUP_TARGET:.0f}x",
            speedup >= ATTENTION_SPEEDUP_TARGET,
            err,
        )
    ]
    ref_ms = median_ms(lambda: reference(q, k, v, positions, scale), args.warmup, args.reps)
    rows.append(
        Row(
            "attention_at_positions (bf16)",
            shape,
            kernel_ms,
            "torch reference op (fp32)",
            ref_ms,
            f"{ref_ms / kernel_ms:.1f}x faster",
            "-",
            None,
            err,
        )
    )
    return rows


def bench_paged_attention(args) -> list[Row]:
    return [row for num_k in args.keys for row in _bench_paged_attention(args, num_k)]


def _bench_paged_attention(args, num_k: int) -> list[Row]:
    from lmcache_backend.backends.cuda.attention import attention_at_positions
    from lmcache_backend.backends.cuda.attention_tiling import default_paged_tiling
    from lmcache_backend.backends.cuda.paged_attention import paged_attention_at_positions
    from lmcache_backend.ops.reference import attention_at_positions as reference

    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    num_q = int(num_k * args.query_ratio)
    dtype, bs = torch.bfloat16, PAGED_BLOCK_SIZE
    blocks = -(-num_k // bs)
    q = torch.randn(num_q, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(blocks * bs, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(blocks * bs, hkv, d, device="cuda", dtype=dtype)
    # The request's blocks scattered over a cache twice as large, as an engine's block pool is.
    key_cache = torch.zeros(2 * blocks, bs, hkv, d, device="cuda", dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    table = torch.randperm(2 * blocks, device="cuda")[:blocks].to(torch.int32)
    key_cache[table.long()] = k.view(blocks, bs, hkv, d)
    value_cache[table.long()] = v.view(blocks, bs, hkv, d)
    k, v = k[:num_k], v[:num_k]
    positions = torch.randperm(num_k - 1, device="cuda")[: num_q - 1].sort().values
    positions = torch.cat([positions, torch.tensor([num_k - 1], device="cuda")])
    scale = d**-0.5

    def paged():
        return paged_attention_at_positions(q, key_cache, value_cache, table, positions, scale)

    def gathered():
        kc = key_cache.index_select(0, table.long()).flatten(0, 1)[:num_k]
        vc = value_cache.index_select(0, table.long()).flatten(0, 1)[:num_k]
        return attention_at_positions(q, kc, vc, positions, scale)

    err = relative_error(paged(), reference(q, k, v, positions, scale))
    paged_ms = median_ms(paged, args.warmup, args.reps)
    contiguous_ms = median_ms(
        lambda: attention_at_positions(q, k, v, positions, scale), args.warmup, args.reps
    )
    # what bounds the paged kernel: the contiguous kernel at the paged kernel's tiles with
    # pointer loads, as a paged read must make them (Hopper's TMA copies boxes, not gathers)
    pointer = replace(default_paged_tiling(d, d, False), prefetch=False)
    pointer_ms = median_ms(
        lambda: attention_at_positions(q, k, v, positions, scale, tiling=pointer),
        args.warmup,
        args.reps,
    )
    gathered_ms = median_ms(gathered, args.warmup, args.reps)
    shape = f"Nk={num_k} Nq={num_q} Hq={hq} Hkv={hkv} D={d} BS={bs}"
    name = "paged_attention_at_positions (bf16)"
    speedup = gathered_ms / paged_ms
    return [
        Row(
            name,
            shape,
            paged_ms,
            "contiguous kernel, same K/V",
            contiguous_ms,
            f"{paged_ms / contiguous_ms:.2f}x its time",
            "-",
            None,
            err,
        ),
        Row(
            name,
            shape,
            paged_ms,
            "contiguous kernel, same tiles, pointer loads (no TMA)",
            pointer_ms,
            f"{paged_ms / pointer_ms:.2f}x its time",
            "-",
            None,
            err,
        ),
        Row(
            name,
            shape,
            paged_ms,
            "gather blocks + contiguous kernel",
            gathered_ms,
            f"{speedup:.2f}x faster",
            f">= {PAGED_SPEEDUP_TARGET:.0f}x",
            speedup >= PAGED_SPEEDUP_TARGET,
            err,
        ),
    ]


def print_table(rows: list[Row], copy_bw: float, device: str) -> None:
    print(f"device: {device}; torch {torch.__version__}")
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write, 1 GiB bf16)\n")
    header = (
        "| op | shape | kernel ms (median) | baseline | baseline ms (median) | result | target "
        "| met | rel. error vs reference |"
    )
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        met = "-" if r.ok is None else ("yes" if r.ok else "NO")
        print(
            f"| {r.case} | {r.shape} | {r.kernel_ms:.3f} | {r.baseline} | {r.baseline_ms:.3f} "
            f"| {r.metric} | {r.target} | {met} | {r.rel_err:.1e} |"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=262144, help="rows for the copy-like ops")
    parser.add_argument(
        "--keys",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[8192, 32768],
        help="key counts for attention, comma-separated",
    )
    parser.add_argument("--query-ratio", type=float, default=0.15)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    return parser.parse_args(argv)


def unavailable_reason() -> str | None:
    """Why the kernels cannot be timed here (no GPU, no triton, the interpreter), or None."""
    if not torch.cuda.is_available():
        return (
            "benchmarks/kernels.py measures the Triton kernels on a CUDA GPU, and none is visible "
            "here (torch.cuda.is_available() is False). Run it on a machine with an NVIDIA GPU; "
            "for correctness without one, run the interpreter tests: "
            "TRITON_INTERPRET=1 pytest tests/backends/cuda/test_cuda_*.py"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: this package's [cuda] extra brings it"
    from lmcache_backend.backends.cuda._common import interpret_mode

    if interpret_mode():
        return (
            "TRITON_INTERPRET is set: kernels would run in the CPU interpreter; unset it to time "
            "them on the GPU"
        )
    return None


def run(args: argparse.Namespace) -> tuple[list[Row], float]:
    """Every row and the copy bandwidth (bytes/s); call after :func:`unavailable_reason`."""
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(args.warmup, args.reps)
    rows = [
        bench_rope(args, copy_bw),
        *bench_rows(args, copy_bw),
        *bench_attention(args),
        *bench_paged_attention(args),
    ]
    return rows, copy_bw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    rows, copy_bw = run(args)
    print_table(rows, copy_bw, torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
