"""Sweep the attention kernels' tilings and the row copies' tiles on a GPU.

``benchmarks/kernels.py`` times each kernel as it ships; this script times the choices behind it,
so a default can be picked from measurements on the device at hand:

* ``attention_at_positions`` and ``paged_attention_at_positions`` at 8k and 32k keys (bf16,
  32 query and 8 KV heads of 128, 15% of the positions as sorted queries, the last included; the
  paged cache in blocks of 16 shuffled over a pool twice the request's size) for tile sizes x
  the tiling choices of :class:`~lmcache_backend.backends.cuda.attention_tiling.AttentionTiling`
  (split, heavy-first, TMA for the contiguous kernel, prefetch for the paged one), next to torch
  SDPA with the explicit mask and to gathering the blocks before the contiguous kernel;
* ``gather_rows`` / ``scatter_rows`` for elements per program and warps.

Every configuration's output is checked against the torch reference first (relative error);
one that fails to compile or run is reported with its error and the sweep goes on. Times are
GPU time (``kernels.py``'s ``median_ms``: the host's launch cost is outside the interval).

Usage::

    python benchmarks/kernel_sweep.py --json sweep.json      # about 2-3 min on an H100
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import torch


def _kernels_module():
    path = Path(__file__).with_name("kernels.py")
    spec = importlib.util.spec_from_file_location("lmcache_backend_benchmark_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


K = _kernels_module()

TILES = ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3))
CONTIGUOUS_CHOICES = {
    "plain": {},
    "split": {"split": True},
    "split+heavy": {"split": True, "heavy_first": True},
    "split+heavy+tma": {"split": True, "heavy_first": True, "tma": True},
}
PAGED_CHOICES = {
    "plain": {},
    "split+heavy": {"split": True, "heavy_first": True},
    "prefetch": {"prefetch": True},
    "split+heavy+prefetch": {"split": True, "heavy_first": True, "prefetch": True},
}
#: (elements per program, warps) of the row copies
ROW_TILES = ((4096, 8), (8192, 8), (16384, 8), (4096, 4), (16384, 16))


def attention_inputs(num_k: int, args) -> dict:
    hq, hkv, d, bs = args.q_heads, args.kv_heads, args.head_dim, K.PAGED_BLOCK_SIZE
    num_q = int(num_k * args.query_ratio)
    dtype = torch.bfloat16
    blocks = -(-num_k // bs)
    q = torch.randn(num_q, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(blocks * bs, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(blocks * bs, hkv, d, device="cuda", dtype=dtype)
    key_cache = torch.zeros(2 * blocks, bs, hkv, d, device="cuda", dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    table = torch.randperm(2 * blocks, device="cuda")[:blocks].to(torch.int32)
    key_cache[table.long()] = k.view(blocks, bs, hkv, d)
    value_cache[table.long()] = v.view(blocks, bs, hkv, d)
    positions = torch.randperm(num_k - 1, device="cuda")[: num_q - 1].sort().values
    positions = torch.cat([positions, torch.tensor([num_k - 1], device="cuda")])
    return {
        "q": q,
        "k": k[:num_k].contiguous(),
        "v": v[:num_k].contiguous(),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "table": table,
        "positions": positions,
        "scale": d**-0.5,
        "flop": 4 * hq * d * float((positions + 1).sum()),
        "shape": f"Nk={num_k} Nq={num_q} Hq={hq} Hkv={hkv} D={d}",
    }


def _timed(fn, reference, args) -> dict:
    try:
        err = K.relative_error(fn(), reference)
        ms = K.median_ms(fn, args.warmup, args.reps)
        return {"ms": ms, "rel_err": err}
    except Exception as exc:  # noqa: BLE001 - a configuration that fails is a result too
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def sweep_attention(args) -> list[dict]:
    out = []
    for num_k in args.keys:
        out += _attention_at(num_k, args)
        torch.cuda.empty_cache()
    return out


def _attention_at(num_k: int, args) -> list[dict]:
    """Every tiling of both kernels at ``num_k`` keys, SDPA with the mask, and the gather."""
    import torch.nn.functional as F

    from lmcache_backend.backends.cuda.attention import attention_at_positions
    from lmcache_backend.backends.cuda.attention_tiling import AttentionTiling
    from lmcache_backend.backends.cuda.paged_attention import paged_attention_at_positions
    from lmcache_backend.ops.reference import attention_at_positions as reference

    x = attention_inputs(num_k, args)
    q, k, v, pos, scale = x["q"], x["k"], x["v"], x["positions"], x["scale"]
    caches = (x["key_cache"], x["value_cache"], x["table"])
    want = reference(q, k, v, pos, scale)
    base = {"keys": num_k, "shape": x["shape"], "flop": x["flop"]}
    out = []

    def record(entry: dict) -> None:
        out.append({**base, **entry})
        print(json.dumps(out[-1]), flush=True)

    group = q.shape[1] // k.shape[1]
    mask = (torch.arange(num_k, device="cuda")[None, :] <= pos[:, None])[None, None]
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    v4 = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)

    def sdpa():
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1)

    record({"kernel": "sdpa+mask", **_timed(sdpa, want, args)})
    for tiles in TILES:
        for name, choice in CONTIGUOUS_CHOICES.items():
            tiling = AttentionTiling(*tiles, **choice)

            def contiguous(t=tiling):
                return attention_at_positions(q, k, v, pos, scale, tiling=t)

            got = _timed(contiguous, want, args)
            record({"kernel": "contiguous", "tiles": tiles, "choice": name, **got})
        for name, choice in PAGED_CHOICES.items():
            tiling = AttentionTiling(*tiles, **choice)

            def paged(t=tiling):
                return paged_attention_at_positions(q, *caches[:2], caches[2], pos, scale, tiling=t)

            record({"kernel": "paged", "tiles": tiles, "choice": name, **_timed(paged, want, args)})

    table = caches[2].long()

    def gathered():  # the blocks gathered, then the contiguous kernel as it ships
        kc = caches[0].index_select(0, table).flatten(0, 1)[:num_k]
        vc = caches[1].index_select(0, table).flatten(0, 1)[:num_k]
        return attention_at_positions(q, kc, vc, pos, scale)

    record({"kernel": "gather+contiguous", **_timed(gathered, want, args)})
    return out


def sweep_rows(args) -> list[dict]:
    from lmcache_backend.backends.cuda import rows

    tokens, width = args.tokens, args.kv_heads * args.head_dim
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    idx = torch.randperm(tokens, device="cuda")[: tokens // 2].sort().values
    src = torch.randn(idx.numel(), width, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty(idx.numel(), width, device="cuda", dtype=torch.bfloat16)
    n = idx.numel()
    out = []
    for elements, warps in ROW_TILES:
        block_f = min(width, 1024)
        block_n = max(elements // block_f, 1)
        grid = (-(-n // block_n), -(-width // block_f))

        def gather(bn=block_n, bf=block_f, w=warps, g=grid):
            rows._gather_rows_kernel[g](
                x, idx, dst, n, tokens, width, x.stride(0), dst.stride(0),
                BLOCK_N=bn, BLOCK_F=bf, num_warps=w,
            )  # fmt: skip
            return dst

        def scatter(bn=block_n, bf=block_f, w=warps, g=grid):
            rows._scatter_rows_kernel[g](
                x, idx, src, n, tokens, width, x.stride(0), src.stride(0),
                BLOCK_N=bn, BLOCK_F=bf, num_warps=w,
            )  # fmt: skip
            return x

        for name, fn, want in (
            ("gather", gather, x.index_select(0, idx)),
            ("scatter", scatter, x.clone().index_copy_(0, idx, src)),
        ):
            out.append(
                {"kernel": name, "elements": elements, "warps": warps, **_timed(fn, want, args)}
            )
            print(json.dumps(out[-1]), flush=True)
    for name, fn in (
        ("torch index_select", lambda: torch.index_select(x, 0, idx, out=dst)),
        ("torch index_copy_", lambda: x.index_copy_(0, idx, src)),
        ("copy_ of as many rows", lambda: dst.copy_(src)),
    ):
        out.append({"kernel": name, "ms": K.median_ms(fn, args.warmup, args.reps)})
        print(json.dumps(out[-1]), flush=True)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--keys", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768]
    )
    parser.add_argument("--query-ratio", type=float, default=0.15)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=262144)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = K.unavailable_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    torch.manual_seed(0)
    start = time.monotonic()
    result = {"device": torch.cuda.get_device_name(), "copy_gbs": 0.0}
    try:
        result["copy_gbs"] = K.copy_bandwidth(args.warmup, args.reps) / 1e9
        result["rows"] = sweep_rows(args)
        result["attention"] = sweep_attention(args)
    except Exception:  # noqa: BLE001 - keep what was measured
        result["error"] = traceback.format_exc()[-2000:]
    result["seconds"] = time.monotonic() - start
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
