"""The load benchmark's clients: streaming chat requests over HTTP (``httpx``, asyncio), either
``clients`` closed-loop clients (each sends its next request when its last one ends) or an
open-loop Poisson arrival process of ``rate`` requests per second (requests start on schedule
whatever the server's state). Every ``window`` completed requests it reads the server's
``/metrics``."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_backend.bench.load_test.stats import METRIC_COUNTERS
from lmcache_backend.bench.load_test.workload import LoadRequest, mixed_up


@dataclass
class PhaseSpec:
    """How a phase sends its requests: ``params`` (``kv_transfer_params``), ``salt`` (a
    unique ``cache_salt`` per request: neither vLLM's prefix cache nor the store serves it) and
    ``same_prompt`` (every request sends the phase's first prompt: vLLM's prefix cache serves all
    of it but the last block)."""

    name: str
    params: dict[str, Any] | None = None
    unique_salt: bool = False
    same_prompt: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def request_body(
    spec: PhaseSpec, req: LoadRequest, model: str, max_tokens: int, run_id: str
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": req.messages(),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # every stream runs its max_tokens: the gaps measured come from streams still running
        "ignore_eos": True,
        **spec.extra,
    }
    if spec.params is not None:
        body["kv_transfer_params"] = spec.params
    if spec.unique_salt:
        body["cache_salt"] = f"{run_id}-{spec.name}-{req.index}"
    return body


def parse_metrics(text: str) -> dict[str, float]:
    """The connector's counters of :data:`METRIC_COUNTERS`, summed over labels."""
    from lmcache_backend.integration.vllm.serving.process import metric_totals

    return metric_totals(text, METRIC_COUNTERS)


async def _stream(client: Any, url: str, body: dict[str, Any], t0: float) -> dict[str, Any]:
    """One streamed request: times of its content chunks and its text."""
    start = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    response_id = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            response_id = response_id or chunk.get("id")
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    times.append(time.perf_counter())
                    parts.append(text)
    end = time.perf_counter()
    return {
        "ok": True,
        "error": None,
        "ttft_s": times[0] - start if times else None,
        "gaps_s": [b - a for a, b in zip(times, times[1:])],
        "tokens": len(times),
        "text": "".join(parts),
        "start_s": start - t0,
        "end_s": end - t0,
        "response_id": response_id,
    }


async def run_phase(
    url: str,
    model: str,
    spec: PhaseSpec,
    requests: list[LoadRequest],
    *,
    clients: int = 4,
    rate: float | None = None,
    max_tokens: int = 32,
    window: int = 100,
    timeout_s: float = 600.0,
    seed: int = 0,
    run_id: str = "load",
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Send ``requests``; returns every request's result, the phase's wall time and the
    ``/metrics`` snapshots (at the start, every ``window`` completions, and at the end)."""
    import httpx

    all_codes = {r.code for r in requests}
    results: list[dict[str, Any] | None] = [None] * len(requests)
    snapshots: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def scrape(done: int) -> None:
            try:
                resp = await client.get(f"{url}/metrics", timeout=30)
                counters = parse_metrics(resp.text)
            except Exception as exc:  # noqa: BLE001 - a missed scrape leaves a gap, no more
                counters = {"error": repr(exc)}
            snapshots.append({"requests": done, "t_s": time.perf_counter() - t0, **counters})

        t0 = time.perf_counter()
        await scrape(0)
        t0 = time.perf_counter()
        done = 0

        async def one(req: LoadRequest) -> None:
            nonlocal done
            body = request_body(spec, req, model, max_tokens, run_id)
            try:
                out = await _stream(client, url, body, t0)
            except Exception as exc:  # noqa: BLE001 - counted as an error of the phase
                now = time.perf_counter() - t0
                out = {"ok": False, "error": repr(exc)[:300], "ttft_s": None, "gaps_s": []}
                out.update(tokens=0, text="", start_s=None, end_s=now)
            out["index"] = req.index
            out["code"] = req.code
            out["mixed"] = sorted(mixed_up(out["text"], req.code, all_codes))
            out["own"] = req.code in out["text"]
            results[req.index] = out
            done += 1
            if progress is not None:
                progress(1)
            if done % window == 0 and done < len(requests):
                await scrape(done)

        if rate:
            rng = random.Random(f"load-arrivals-{seed}")
            tasks, at = [], 0.0
            for req in requests:
                at += rng.expovariate(rate)
                delay = at - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            await asyncio.gather(*tasks)
        else:
            queue: asyncio.Queue[LoadRequest] = asyncio.Queue()
            for req in requests:
                queue.put_nowait(req)

            async def worker() -> None:
                while not queue.empty():
                    await one(queue.get_nowait())

            await asyncio.gather(*(worker() for _ in range(max(1, clients))))
        wall = time.perf_counter() - t0
        await scrape(done)
    return {"results": results, "wall_s": wall, "snapshots": snapshots}
