"""``lmcache-backend bench --client langchain|llamaindex|all``: stock RAG clients on the server.

LangChain and LlamaIndex build and send their own RAG prompts, unchanged, to ``lmcache-backend
serve`` (vLLM's OpenAI server with the CacheBlend connector). For each prompt shape and each
example of the dev set:

1. **warm**: the documents in order with a warm-up question (the connector stores them);
2. **reordered**: the documents reordered with the example's question (never sent before),
   blended and as a full prefill on the same server (opted out, ``kv_transfer_params={"blend":
   false}``, with a ``cache_salt`` of its own: neither vLLM's prefix cache nor the store serves
   it, whatever the server's prefix caching); which goes first alternates from example to
   example;
3. **new document**: the reordered documents plus one document never sent before (another
   example's) with that example's question, blended, then as a full prefill.

TTFT is the time to the first streamed text through the framework's own streaming API. Reuse
comes from the server's ``stats_file``, one request at a time. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from lmcache_backend.bench.frameworks.common import FULL_PREFILL_NOTE, Answer, Reuse, StatsFile

CLIENTS = {
    "langchain": ("langchain-stock", "langchain-one-message"),
    "llamaindex": ("llamaindex-completions", "llamaindex-chat"),
}
CLIENTS["all"] = CLIENTS["langchain"] + CLIENTS["llamaindex"]
SERVER_ARGS = ["--no-enable-prefix-caching", "--max-model-len", "4096"]


def make_shape(name: str, base_url: str, model: str, max_tokens: int, context_window: int) -> Any:
    """The shape's client (the framework is imported here: install ``.[clients]``)."""
    if name.startswith("langchain-"):
        from lmcache_backend.bench.frameworks import langchain as module
    elif name.startswith("llamaindex-"):
        from lmcache_backend.bench.frameworks import llamaindex as module
    else:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(CLIENTS['all'])}")
    return module.make_shape(name, base_url, model, max_tokens, context_window, 600.0)


def served_model(base_url: str) -> tuple[str, int]:
    """The server's model name and context length (``/v1/models``)."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as resp:
        card = json.load(resp)["data"][0]
    return card["id"], int(card.get("max_model_len") or 4096)


def _call(stats: StatsFile, shape: Any, docs: list[str], question: str, blend: bool) -> dict:
    answer, reuse = stats.around(lambda: shape.ask(docs, question, blend))
    return {"answer": answer.__dict__, "reuse": reuse.as_dict()}


def _pair(stats, shape, docs, question, blend_first: bool) -> dict[str, Any]:
    out = {}
    for blend in (True, False) if blend_first else (False, True):
        out["blend" if blend else "full"] = _call(stats, shape, docs, question, blend)
    out["ratio"] = out["blend"]["answer"]["ttft_s"] / max(out["full"]["answer"]["ttft_s"], 1e-9)
    return out


def new_document(example: Any) -> str:
    """The document ``example``'s question is about (the dev set's gold profile; in other data
    the first chunk holding an answer, else the first chunk)."""
    from lmcache_backend.bench.datasets.devset import gold_chunk

    try:
        return gold_chunk(example)
    except ValueError:
        low = [a.lower() for a in example.answers]
        return next(
            (c for c in example.chunks if any(a in c.lower() for a in low)), example.chunks[0]
        )


def run_shape(shape: Any, stats: StatsFile, examples: list, extras: list, out=sys.stdout) -> list:
    """Every example through one shape; ``extras[i]``: the never-seen example of example i."""
    from lmcache_backend.bench.datasets.dataset import WARM_QUESTION
    from lmcache_backend.bench.quality.metrics import answer_correct
    from lmcache_backend.data.examples import reordered

    for blend in (True, False):  # neither side's first timed request sets up its client
        shape.ask(["The sky is blue."], "What colour is the sky?", blend)
    rows = []
    for i, (ex, extra) in enumerate(zip(examples, extras)):
        again = reordered(ex.chunks, seed=i + 1)
        mid = len(again) // 2
        with_new = again[:mid] + [new_document(extra)] + again[mid:]
        row = {
            "id": ex.id,
            "warm": _call(stats, shape, ex.chunks, WARM_QUESTION, True),
            "reordered": _pair(stats, shape, again, ex.question, blend_first=i % 2 == 0),
            "new_document": _pair(stats, shape, with_new, extra.question, blend_first=True),
        }
        for case, gold in (("reordered", ex.answers), ("new_document", extra.answers)):
            for side in ("blend", "full"):
                call = row[case][side]
                call["correct"] = answer_correct(call["answer"]["text"], gold)
        rows.append(row)
        r, b = row["reordered"], row["reordered"]["blend"]["reuse"]
        print(
            f"  {shape.name} {ex.id}: reordered {'blended' if b['blended'] else 'NOT blended'} "
            f"({b['share']:.0%} reused), TTFT ratio {r['ratio']:.2f}; new document "
            f"{row['new_document']['ratio']:.2f}",
            file=out,
            flush=True,
        )
    return rows


def summarize(rows: list[dict]) -> dict[str, Any]:
    """One shape's numbers: prompts blended, median reused share and TTFT ratio (reordered),
    the largest TTFT ratio with a new document, correct answers."""

    def count(case: str, side: str, key: str) -> int:
        return sum(
            bool(r[case][side][key] if key == "correct" else r[case][side]["reuse"][key])
            for r in rows
        )

    reasons = sorted({r["reordered"]["blend"]["reuse"]["reason"] or "" for r in rows} - {""})
    return {
        "prompts": len(rows),
        "blended": count("reordered", "blend", "blended"),
        "new_document_blended": count("new_document", "blend", "blended"),
        # opted-out requests the connector blended anyway (0: the opt-out reached it)
        "opted_out_blended": count("reordered", "full", "blended")
        + count("new_document", "full", "blended"),
        "reused_share": statistics.median(r["reordered"]["blend"]["reuse"]["share"] for r in rows),
        "ttft_ratio": statistics.median(r["reordered"]["ratio"] for r in rows),
        "new_document_max_ratio": max(r["new_document"]["ratio"] for r in rows),
        "correct_blend": count("reordered", "blend", "correct"),
        "correct_full": count("reordered", "full", "correct"),
        "not_blended_reasons": reasons,
    }


def format_table(summaries: dict[str, dict]) -> str:
    head = (
        f"{'shape':<24} {'blended':>8} {'reused':>7} {'TTFT blend/full':>16} "
        f"{'new doc blended':>16} {'new doc max':>12} {'correct b/f':>12}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        n = s["prompts"]
        lines.append(
            f"{name:<24} {s['blended']:>4}/{n:<3} {s['reused_share']:>7.0%} "
            f"{s['ttft_ratio']:>16.2f} {s['new_document_blended']:>12}/{n:<3} "
            f"{s['new_document_max_ratio']:>12.2f} {s['correct_blend']:>6}/{s['correct_full']:<5}"
        )
    return "\n".join(lines)


def pick_examples(
    dataset: str | None, count: int, shapes: int, longest: bool = False
) -> tuple[list, list[list]]:
    """``count`` examples, and per shape ``count`` further ones whose document is never sent
    otherwise (each shape gets its own new documents). ``longest``: the examples with the most
    document text first."""
    from lmcache_backend.bench.datasets.dataset import DEV_DATASET, load_dataset

    pool = load_dataset(dataset or DEV_DATASET)
    if longest:
        pool = sorted(pool, key=lambda ex: -sum(len(c) for c in ex.chunks))
    if count < 1 or count * (1 + shapes) > len(pool):
        raise SystemExit(
            f"bench: --examples {count} with {shapes} shapes needs {count * (1 + shapes)} "
            f"examples (each new-document prompt takes another example's); the dataset has "
            f"{len(pool)}: choose --examples {len(pool) // (1 + shapes)} or fewer"
        )
    return pool[:count], [pool[count * (1 + s) : count * (2 + s)] for s in range(shapes)]


def add_arguments(parser: argparse.ArgumentParser, standalone: bool = False) -> None:
    """The ``--client`` flags (``standalone``: also those ``bench`` already has)."""
    group = parser.add_argument_group("stock RAG clients (--client)")
    group.add_argument(
        "--client",
        choices=sorted(CLIENTS),
        default="all" if standalone else None,
        help="instead: send LangChain's or LlamaIndex's own RAG prompts to the server",
    )
    group.add_argument("--examples", type=int, default=12, help="dev-set examples (default: 12)")
    group.add_argument("--shapes", help="comma list of prompt shapes (default: the client's)")
    group.add_argument(
        "--longest",
        action="store_true",
        help="the examples with the most document text (dev set: ~1,100-token prompts)",
    )
    group.add_argument("--url", help="a running server (default: start one on this machine)")
    group.add_argument("--stats-file", help="the running server's stats_file (with --url)")
    group.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the started server, repeatable (e.g. LMCACHE_BLEND_SPECIAL_STR=)",
    )
    group.add_argument("--eager", action="store_true", help="start the server --enforce-eager")
    if standalone:
        parser.add_argument("--dataset", help="RAG examples, JSONL (default: the dev set)")
        parser.add_argument("--max-new-tokens", type=int, default=16)
        parser.add_argument("--json", metavar="PATH", help="write every number as JSON")


def _shapes(args: argparse.Namespace) -> list[str]:
    names = CLIENTS[args.client]
    if args.shapes:
        wanted = [s.strip() for s in args.shapes.split(",") if s.strip()]
        bad = [s for s in wanted if s not in names]
        if bad or not wanted:
            raise SystemExit(f"bench: --client {args.client} has no shapes {bad}: {names}")
        names = tuple(wanted)
    return list(names)


def run(args: argparse.Namespace, out=sys.stdout) -> dict[str, Any]:
    """Run the shapes the flags ask for (starting a server unless ``--url``); print the table."""
    from lmcache_backend.bench.server import bench_server

    names = _shapes(args)
    env = dict(item.split("=", 1) for item in args.server_env)
    examples, extras = pick_examples(
        args.dataset, args.examples, len(names), getattr(args, "longest", False)
    )
    if args.url and not args.stats_file:
        print("no --stats-file: every request reads as not blended", file=out)
    print(FULL_PREFILL_NOTE, file=out)
    vllm_args = SERVER_ARGS + (["--enforce-eager"] if args.eager else [])
    served = bench_server(
        args.url, args.stats_file, vllm_args, env, out, "lmcache-backend-clients-"
    )
    with served as (url, stats_path, _):
        stats = StatsFile(stats_path)
        started = time.perf_counter()
        result: dict[str, Any] = {
            "setup": {
                "url": url,
                "server_env": env,
                "eager": args.eager,
                "examples": len(examples),
                "full_prefill": FULL_PREFILL_NOTE,
                "load_before": os.getloadavg(),
            }
        }
        model, context = served_model(url)
        result["setup"]["model"] = model
        shapes: dict[str, Any] = {}
        for name in names:
            shape = make_shape(name, url, model, args.max_new_tokens, context)
            rows = run_shape(shape, stats, examples, extras[names.index(name)], out)
            shapes[name] = {"summary": summarize(rows), "examples": rows}
    result["shapes"] = shapes
    result["setup"].update(wall_s=time.perf_counter() - started, load_after=os.getloadavg())
    print(format_table({n: s["summary"] for n, s in shapes.items()}), file=out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_backend.bench.frameworks.clients")
    add_arguments(parser, standalone=True)
    run(parser.parse_args(argv))
    return 0


__all__ = ["Answer", "Reuse", "StatsFile", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
