"""What vLLM's CPU paged attention costs for a blend's selected queries, against a full prefill.

``python -m lmcache_backend.bench.profiling.paged_attention [--sizes 1000,2000,4000] [--ratio
0.15]`` writes random bf16 K/V of a ``T``-token prompt into a paged cache (SmolLM2's geometry: 9
query heads, 3 KV heads, head dim 64, vLLM's CPU block size) and times one layer's attention through
the op the connector uses (:class:`~lmcache_backend.integration.vllm.layouts.CpuAttention`):

* every token (a full prefill's attention, one run of ``T`` queries);
* ``ratio * T`` queries at random positions (one request per run of consecutive positions);
* the same number in runs of 8 consecutive positions.

Each line gives the medians and, per selection, its time and its query-key pairs as shares of
the full prefill's: when the two shares are close, the kernel spends about as much per pair on
scattered queries as on a full prefill, and the attention a blend costs is set by how many pairs
its selection has (late tokens read more keys).

``--spans 1,2,4,8,16`` instead times ``ratio * T`` queries in aligned spans of each length,
drawn with a weight growing with position (as a blend's selection favours late tokens), and
prints each one's cost per pair against a full prefill's (``blend_selection_span``), through
vLLM's kernel and through the blend's tiled kernel (``selected_attention``, where it runs).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(times)


def _pairs(positions: torch.Tensor) -> float:
    """Query-key pairs of queries at ``positions``: a query at ``p`` reads ``p + 1`` keys."""
    return float((positions.to(torch.float64) + 1).sum())


def measure(num_tokens: int, ratio: float, block_size: int, repeats: int) -> dict[str, float]:
    """Milliseconds and pair shares of one layer's attention for the three query sets."""
    g = torch.Generator().manual_seed(num_tokens)
    cache, block_ids, attention = _cache_and_attention(num_tokens, block_size, g, split_kv=False)
    count = max(8, int(ratio * num_tokens)) // 8 * 8
    scattered = torch.randperm(num_tokens, generator=g)[:count].sort().values
    starts = torch.randperm(num_tokens // 8, generator=g)[: count // 8].sort().values * 8
    runs = (starts[:, None] + torch.arange(8)).flatten()
    row = {}
    for name, positions in (
        ("full", torch.arange(num_tokens)),
        ("scattered", scattered),
        ("runs of 8", runs),
    ):
        row[f"{name} ms"] = _time_queries(cache, block_ids, attention, positions, g, repeats)
        row[f"{name} pairs"] = _pairs(positions)
    for name in ("scattered", "runs of 8"):
        row[f"{name} time share"] = row[f"{name} ms"] / row["full ms"]
        row[f"{name} pair share"] = row[f"{name} pairs"] / row["full pairs"]
    return row


def _cache_and_attention(
    num_tokens: int, block_size: int, g: torch.Generator, split_kv: bool = True
):
    """A paged bf16 cache holding random K/V of ``num_tokens`` tokens, its block ids, and the
    CPU attention op the connector uses (``split_kv``: vLLM's default, on)."""
    from vllm import _custom_ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from lmcache_backend.integration.vllm.layouts import CpuAttention, CpuLayout, slots_for

    dtype = torch.bfloat16
    isa = _get_attn_isa(dtype, block_size, HEAD_DIM, "auto")
    layout = CpuLayout(
        _custom_ops.cpu_attn_reshape_and_cache, isa, KV_HEADS, block_size, HEAD_DIM, dtype
    )
    num_blocks = -(-num_tokens // block_size)
    cache = torch.zeros(num_blocks, KV_HEADS, block_size, 2 * HEAD_DIM, dtype=dtype)
    block_ids = torch.arange(num_blocks)
    keys, values = (
        torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in "kv"
    )
    layout.write(cache, keys, values, slots_for(block_ids.tolist(), block_size, 0, num_tokens))
    return cache, block_ids, CpuAttention(isa, HEADS, KV_HEADS, HEAD_DIM, dtype, split_kv=split_kv)


def _time_queries(cache, block_ids, attention, positions: torch.Tensor, g, repeats: int) -> float:
    """Median ms of one layer's attention for random queries at ``positions [N]`` over
    ``cache`` (``_cache_and_attention``'s)."""
    q = torch.randn(positions.numel(), HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    plan = attention.plan(positions, block_ids)
    return _median_ms(functools.partial(attention, cache, q, plan, 0.125), repeats)


def _tiled_ms(positions: torch.Tensor, num_tokens: int, g, repeats: int) -> float | None:
    """Median ms of the blend's tiled kernel
    (:mod:`lmcache_backend.backends.cpu.tiled_attention`) for
    random queries at ``positions [N]`` over ``num_tokens`` contiguous random bf16 K/V; None
    where it cannot run."""
    from lmcache_backend.backends.cpu.tiled_attention import KernelUnavailable, load_tiled_attention

    try:
        kernel = load_tiled_attention()
    except KernelUnavailable:
        return None
    keys, values = (
        torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in "kv"
    )
    q = torch.randn(positions.numel(), HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    return _median_ms(functools.partial(kernel, q, positions, keys, values, 0.125), repeats)


def measure_spans(
    num_tokens: int, ratio: float, spans: list[int], block_size: int, repeats: int
) -> dict[int, tuple[float, float, float | None]]:
    """Per span length: ``(time share, pair share, tiled time share)`` of one layer's attention
    for ``ratio * num_tokens`` queries in aligned spans of that length (span ``s`` drawn with
    weight ``(s + 1) ** 1.2``: late spans more often), against vLLM's full prefill: through
    vLLM's kernel, and through the blend's tiled kernel (None where it cannot run)."""
    g = torch.Generator().manual_seed(num_tokens)
    cache, block_ids, attention = _cache_and_attention(num_tokens, block_size, g)

    def timed(positions: torch.Tensor) -> float:
        return _time_queries(cache, block_ids, attention, positions, g, repeats)

    every = torch.arange(num_tokens)
    full_ms, full_pairs = timed(every), _pairs(every)
    count = int(ratio * num_tokens)
    shares = {}
    for span in spans:
        weights = (torch.arange(num_tokens // span, dtype=torch.float64) + 1) ** 1.2
        chosen = torch.multinomial(weights, max(1, count // span), generator=g).sort().values
        positions = (chosen[:, None] * span + torch.arange(span)).flatten()
        tiled = _tiled_ms(positions, num_tokens, g, repeats)
        shares[span] = (
            timed(positions) / full_ms,
            _pairs(positions) / full_pairs,
            None if tiled is None else tiled / full_ms,
        )
    return shares


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,2000,4000", help="prompt sizes in tokens")
    parser.add_argument("--ratio", type=float, default=0.15, help="share of tokens selected")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's CPU block size")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per measurement")
    parser.add_argument(
        "--spans", default="", help="span lengths to compare instead, e.g. 1,2,4,8,16"
    )
    args = parser.parse_args(argv)
    print(f"one layer, bf16, {torch.get_num_threads()} threads, {args.ratio:.0%} of the tokens")
    if args.spans:
        spans = [int(s) for s in args.spans.split(",")]
        for size in (int(s) for s in args.sizes.split(",")):
            shares = measure_spans(size, args.ratio, spans, args.block_size, args.repeats)
            print(
                f"{size:6d} tokens: "
                + "; ".join(
                    f"span {span}: {t:.3f} of the time for {p:.3f} of the pairs ({t / p:.2f}x"
                    + (")" if tiled is None else f", tiled kernel {tiled / p:.2f}x)")
                    for span, (t, p, tiled) in shares.items()
                )
            )
        return
    for size in (int(s) for s in args.sizes.split(",")):
        r = measure(size, args.ratio, args.block_size, args.repeats)
        print(
            f"{size:6d} tokens: full prefill {r['full ms']:7.2f} ms; "
            + "; ".join(
                f"{name} {r[f'{name} ms']:6.2f} ms = {r[f'{name} time share']:.2f} of full "
                f"for {r[f'{name} pair share']:.2f} of its pairs"
                for name in ("scattered", "runs of 8")
            )
        )


if __name__ == "__main__":
    main()
