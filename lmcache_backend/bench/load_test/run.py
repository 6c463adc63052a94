"""``lmcache-backend bench --load``: many concurrent RAG chats against one server.

Starts ``lmcache-backend serve`` (or targets ``--url``) and runs phases on that one server, each
over a corpus of its own (``--corpus-chunks`` fictional profiles: every phase starts cold) with
Zipf popularity, ``--requests`` streaming chats each:

* ``full``: every request opted out of reuse and of the store (``kv_transfer_params={"blend":
  false, "lmcache.skip_save": true}``) and carrying a ``cache_salt`` of its own, so neither
  vLLM's prefix cache nor the store serves it, and it writes nothing;
* ``prefix``: opted out, no salt: vLLM's prefix caching alone (the server runs with it on);
* ``blend``: CacheBlend with the server's settings (prefix caching stays on);
* ``ingested``: CacheBlend after ``lmcache-backend ingest`` wrote the phase's corpus into the
  shared tier (:mod:`lmcache_backend.bench.load_test.ingest`), as a fleet pre-encodes its knowledge
  base; ``cached``: the same prompt every time (the bound of any reuse).

Per phase: requests/s, TTFT p50/p90/p99 and inter-token latency p99 (client side), errors, the
share of requests blended and of prompt tokens reused per window of requests (the server's
``stats_file``), the store's hit rate, bytes stored and evictions (``/metrics``), and answers
holding another request's number; for reuse phases run beside ``full`` and ``cached``, the
requests/s their found share and blend time allow (measured / bound). See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lmcache_backend.bench.frameworks.common import FULL_PREFILL_PARAMS
from lmcache_backend.bench.load_test import ingest as load_ingest
from lmcache_backend.bench.load_test import stats as load_stats
from lmcache_backend.bench.load_test.driver import PhaseSpec, run_phase
from lmcache_backend.bench.load_test.workload import build_requests, corpus
from lmcache_backend.settings.writer import variable, variables

PHASES = {
    "full": PhaseSpec("full prefill", params=FULL_PREFILL_PARAMS, unique_salt=True),
    "prefix": PhaseSpec("prefix caching", params={"blend": False}),
    "blend": PhaseSpec("cacheblend"),
    "ingested": PhaseSpec("pre-encoded corpus"),
    # the bound any reuse can reach: prefill (almost) free, decode and the rest as in the others
    "cached": PhaseSpec("prompt cached", params={"blend": False}, same_prompt=True),
}
SERVER_ARGS = ["--enable-prefix-caching", "--max-model-len", "4096"]


def add_arguments(parser: argparse.ArgumentParser, standalone: bool = False) -> None:
    """The ``--load`` flags (``standalone``: also those ``bench`` already has)."""
    g = parser.add_argument_group("load benchmark (--load)")
    if not standalone:
        g.add_argument(
            "--load",
            action="store_true",
            help="instead: concurrent streaming RAG chats against one server, per phase",
        )
    g.add_argument("--clients", type=int, default=4, help="closed-loop clients (default: 4)")
    g.add_argument(
        "--rate", type=float, default=None, help="open loop: Poisson arrivals, requests per second"
    )
    g.add_argument("--requests", type=int, default=1000, help="requests per phase (default: 1000)")
    g.add_argument(
        "--corpus-chunks", type=int, default=200, help="chunks in each phase's corpus (200)"
    )
    g.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of popularity (1.0)")
    g.add_argument("--k", type=int, default=5, help="corpus chunks per request (default: 5)")
    g.add_argument(
        "--phases",
        default="full,prefix,blend",
        help="comma list of full, prefix, blend, ingested (CacheBlend with the phase's corpus "
        "written into the shared tier by lmcache-backend ingest first), cached (the same prompt "
        "every time, served by vLLM's prefix cache: the throughput no reuse can exceed)",
    )
    g.add_argument("--stream-tokens", type=int, default=32, help="tokens per answer (32)")
    g.add_argument("--window", type=int, default=100, help="requests per window (default: 100)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    g.add_argument(
        "--store-share",
        type=float,
        default=1 / 3,
        help="a started server's CPU store holds this share of one phase's corpus "
        "(LMCACHE_MAX_LOCAL_CPU_SIZE from the corpus' tokens and the model's K/V bytes per "
        "token; default: a third; 0: the server's own setting)",
    )
    g.add_argument(
        "--connector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a connector key of the started server's kv_connector_extra_config (e.g. "
        "blend_layers_per_step=0); repeatable",
    )
    if standalone:
        parser.add_argument("--url", help="a running server (default: start one here)")
        parser.add_argument(
            "--stats-file",
            help="the running server's stats_file (with --url), or where the "
            "started server writes it",
        )
        parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE")
        parser.add_argument("--eager", action="store_true", help="start the server eager")
        parser.add_argument("--json", metavar="PATH", help="write every number as JSON")
        parser.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _phases(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PHASES]
    if bad or not names:
        raise SystemExit(f"bench: unknown --phases {bad}: choose from {', '.join(PHASES)}")
    return names


def _check(args: argparse.Namespace) -> None:
    if args.requests < 1 or args.k < 1 or args.window < 1 or args.stream_tokens < 2:
        raise SystemExit("bench: --requests, --k and --window must be >= 1, --stream-tokens >= 2")
    if args.k > args.corpus_chunks:
        raise SystemExit(f"bench: --k {args.k} exceeds --corpus-chunks {args.corpus_chunks}")
    if args.rate is not None and args.rate <= 0:
        raise SystemExit("bench: --rate must be > 0")
    if args.store_share < 0:
        raise SystemExit(f"bench: --store-share {args.store_share} must be >= 0")


def store_size_gb(chunks: list[str], share: float, model: str | None = None) -> float:
    """The CPU store size (GB, as ``max_local_cpu_size`` counts them: GiB) that holds ``share``
    of ``chunks``' K/V: their tokens (the embedded model's tokenizer, or ``model``'s) times
    layers x KV heads x head size x 2 (K and V) x 2 bytes (bf16, what vLLM's CPU build
    computes in)."""
    from transformers import AutoConfig, AutoTokenizer

    from lmcache_backend.data.embedded import resolve_model
    from lmcache_backend.storage.factory import GB

    path = resolve_model(model)
    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = config.num_hidden_layers * kv_heads * head_dim * 2 * 2
    tok = AutoTokenizer.from_pretrained(path)
    tokens = sum(len(tok.encode(c, add_special_tokens=False)) for c in chunks)
    return share * tokens * per_token / GB


def connector_args(items: list[str]) -> list[str]:
    """``--kv-transfer-config`` naming the connector with ``KEY=VALUE`` extra-config keys
    (values read as JSON where they parse, else as text); none: no option (``serve``'s own)."""
    if not items:
        return []
    from lmcache_backend.integration.vllm import kv_transfer_config

    extra: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"bench: --connector {item!r}: expected KEY=VALUE")
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    return ["--kv-transfer-config", json.dumps(kv_transfer_config(**extra))]


def _lines(path: Path | None) -> list[dict[str, Any]]:
    from lmcache_backend.bench.frameworks.common import StatsFile

    return StatsFile(path).lines()


def run(args: argparse.Namespace, out=None) -> dict[str, Any]:
    """Run the phases the flags ask for; print the table (to ``out``, default the current
    ``sys.stdout``) and return every number."""
    out = out or sys.stdout
    from lmcache_backend.bench.server import bench_server

    _check(args)
    names = _phases(args.phases)
    env = dict(item.split("=", 1) for item in args.server_env)
    if not args.url and args.store_share > 0 and variable("max_local_cpu_size") not in env:
        size = store_size_gb(corpus(args.corpus_chunks, seed=args.seed * 100), args.store_share)
        env.update(variables({"max_local_cpu_size": round(size, 4)}))
        print(
            f"store: {variable('max_local_cpu_size')}={size:.4f} ({args.store_share:.0%} of a "
            f"phase's corpus)",
            file=out,
        )
    given_stats = getattr(args, "stats_file", None)
    if args.url and not given_stats:
        print("no --stats-file: blended and reused shares are left out", file=out)
    vllm_args = SERVER_ARGS + (["--enforce-eager"] if args.eager else [])
    vllm_args += connector_args(getattr(args, "connector", []))
    with contextlib.ExitStack() as stack:
        if "ingested" in names and load_ingest.REMOTE_URL not in {**os.environ, **env}:
            if args.url:
                raise SystemExit(
                    "bench: the ingested phase writes into the server's shared tier: give it as "
                    f"--server-env {load_ingest.REMOTE_URL}=..."
                )
            env.update(variables({"remote_url": stack.enter_context(load_ingest.local_redis())}))
            print(f"shared tier: {env[load_ingest.REMOTE_URL]} (a local redis-server)", file=out)
        # a server started here is started after the ingestion: one engine at a time (an
        # ingest engine beside a running server shares its cores); a given one is already up
        pre_encoded = {} if args.url else _pre_encode(args, names, env, None, out)
        served = bench_server(args.url, given_stats, vllm_args, env, out, "lmcache-backend-load-")
        result = _run_phases(args, names, served, env, out, pre_encoded)
    return result


def _pre_encode(args, names, env, model, out) -> dict[int, dict[str, Any]]:
    """``lmcache-backend ingest`` on the corpus of each ``ingested`` phase (by phase index)."""
    return {
        i: load_ingest.pre_encode(
            corpus(args.corpus_chunks, seed=args.seed * 100 + i), env, model, out
        )
        for i, key in enumerate(names)
        if key == "ingested"
    }


def _run_phases(args, names, served, env, out, pre_encoded) -> dict[str, Any]:
    from lmcache_backend.bench.frameworks.clients import served_model

    with served as (url, stats_path, server):
        result: dict[str, Any] = {
            "setup": {
                "url": url,
                "server_args": None if server is None else server.cmd[3:],
                "server_env": env,
                "mode": f"open loop, {args.rate}/s" if args.rate else f"{args.clients} clients",
                "cpu_count": os.cpu_count(),
                "load_before": os.getloadavg(),
            },
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "phases": {},
        }
        run_id = f"load{int(time.time())}"
        model, _ = served_model(url)
        result["setup"]["model"] = model
        _warm_up(url, model, args.stream_tokens)
        for i, key in enumerate(names):
            spec = PHASES[key]
            chunks = corpus(args.corpus_chunks, seed=args.seed * 100 + i)
            reqs = build_requests(
                chunks,
                args.requests,
                args.k,
                args.zipf,
                seed=args.seed * 100 + i,
                first_badge=1 + i * args.requests,
            )
            if spec.same_prompt:
                reqs = [dataclasses.replace(reqs[0], index=j) for j in range(len(reqs))]
            ingest = pre_encoded.get(i)
            if key == "ingested" and ingest is None:  # a given server: its model, now
                ingest = load_ingest.pre_encode(chunks, env, model, out)
            before = len(_lines(stats_path))
            print(f"phase {spec.name}: {len(reqs)} requests ...", file=out, flush=True)
            phase = _run_one(url, model, spec, reqs, args, run_id)
            lines = _lines(stats_path)[before:]
            result["phases"][spec.name] = _phase_result(spec, phase, lines, args.window)
            if ingest is not None:
                result["phases"][spec.name]["ingest"] = ingest
            row = load_stats.format_table({spec.name: result["phases"][spec.name]})
            print(row.split("\n")[-1], file=out, flush=True)
    result["setup"]["load_after"] = os.getloadavg()
    print(load_stats.format_table(result["phases"]), file=out)
    print(load_stats.LEGEND, file=out)
    for name in ("cacheblend", "pre-encoded corpus"):
        bound = load_ingest.reuse_bound(result["phases"], name)
        if bound is not None:
            result["phases"][name]["bound"] = bound
            print(load_ingest.bound_line(name, bound), file=out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    if args.plots:
        from lmcache_backend.bench.load_test.plots import write_load_plots

        for path in write_load_plots(result, args.plots):
            print(f"wrote {path}", file=out)
    return result


def _warm_up(url: str, model: str, max_tokens: int) -> None:
    """One small request, so that no phase pays the server's first-request costs."""
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "kv_transfer_params": {"blend": False},
    }
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()


def _run_one(url, model, spec, reqs, args, run_id) -> dict[str, Any]:
    from tqdm import tqdm

    with tqdm(total=len(reqs), unit="req", disable=args.no_progress, file=sys.stderr) as bar:
        return asyncio.run(
            run_phase(
                url,
                model,
                spec,
                reqs,
                clients=args.clients,
                rate=args.rate,
                max_tokens=args.stream_tokens,
                window=args.window,
                seed=args.seed,
                run_id=run_id,
                progress=bar.update,
            )
        )


def _phase_result(spec: PhaseSpec, phase: dict, lines: list[dict], window: int) -> dict:
    results = phase["results"]
    load_stats.attach_lines(results, lines)
    snaps = [s for s in phase["snapshots"] if "error" not in s]
    windows = [
        {"requests": b["requests"], "t_s": b["t_s"], **load_stats.metric_window(a, b)}
        for a, b in zip(snaps, snaps[1:])
    ]
    return {
        "spec": {"params": spec.params, "unique_salt": spec.unique_salt},
        "summary": load_stats.summarize_phase(results, phase["wall_s"]),
        "by_outcome": load_stats.ttft_by_outcome(results),
        "stats": load_stats.stats_windows(lines, max(len(lines), 1))[0] if lines else None,
        "stats_windows": load_stats.stats_windows(lines, window),
        "metrics": load_stats.metric_window(snaps[0], snaps[-1]) if len(snaps) > 1 else None,
        "metric_windows": windows,
        "throughput_windows": load_stats.throughput_windows(results, window),
        "requests": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_backend.bench.load_test.run")
    add_arguments(parser, standalone=True)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
