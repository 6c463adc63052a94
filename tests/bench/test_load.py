"""The load benchmark's pieces that need no vLLM server: the workload (corpus, Zipf popularity,
request-unique facts), the arithmetic (percentiles, windows) and the streaming driver against a
small fake OpenAI server; one real-server smoke run is marked slow."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from lmcache_backend.bench.load_test import run as load
from lmcache_backend.bench.load_test import stats as load_stats
from lmcache_backend.bench.load_test.driver import PhaseSpec, request_body, run_phase
from lmcache_backend.bench.load_test.workload import (
    STOCK_SYSTEM,
    ZipfSampler,
    build_requests,
    corpus,
    mixed_up,
)


def test_corpus_chunks_are_unique_profiles() -> None:
    chunks = corpus(400, seed=1)  # more than the 384 name pairs
    assert len(set(chunks)) == 400
    names = [re.match(r"Profile of ([^.]+)\.", c).group(1) for c in chunks]
    assert len(set(names)) == 400 and names[-1].endswith(" II")
    assert corpus(5, seed=1) == chunks[:5] and corpus(5, seed=2) != chunks[:5]


def test_zipf_draws_distinct_chunks_with_zipf_frequencies() -> None:
    sampler = ZipfSampler(50, 1.0, random.Random(0))
    p = sampler.probabilities()
    assert p[0] / p[1] == pytest.approx(2.0) and p[0] / p[9] == pytest.approx(10.0)
    firsts = Counter(sampler.draw(1)[0] for _ in range(20000))
    for i in (0, 1, 4, 20):
        assert firsts[i] / 20000 == pytest.approx(p[i], abs=0.01)
    for _ in range(200):
        ids = sampler.draw(5)
        assert len(set(ids)) == 5 and all(0 <= i < 50 for i in ids)
    assert sorted(ZipfSampler(6, 1.0, random.Random(1)).draw(6)) == list(range(6))
    uniform = ZipfSampler(4, 0.0, random.Random(2))
    assert uniform.probabilities() == [0.25] * 4
    with pytest.raises(ValueError):
        ZipfSampler(4, 1.0, random.Random(0)).draw(5)


def test_requests_carry_their_own_fact_in_the_stock_langchain_shape() -> None:
    chunks = corpus(30)
    reqs = build_requests(chunks, 200, 4, 1.0, seed=3, first_badge=11)
    assert len({r.code for r in reqs}) == 200 and all(len(r.code) == 5 for r in reqs)
    assert len({r.question for r in reqs}) == 200
    r = reqs[0]
    assert r.badge == 11 and len(r.docs) == 5
    assert r.code in r.docs[r.note_position] and f"badge {r.badge}" in r.question
    assert [r.docs[i] for i in range(5) if i != r.note_position] == [chunks[i] for i in r.chunk_ids]
    system, user = r.messages()
    assert system["content"] == STOCK_SYSTEM + "\n\n".join(r.docs)
    assert user == {"role": "user", "content": r.question}
    # popular chunks come back: chunk 0 is in far more requests than chunk 29
    counts = Counter(i for q in reqs for i in q.chunk_ids)
    assert counts[0] > 3 * counts[29]
    assert build_requests(chunks, 3, 4, 1.0, seed=3) == build_requests(chunks, 3, 4, 1.0, seed=3)


def test_an_answer_with_another_requests_number_is_mixed_up() -> None:
    codes = {"12345", "67890", "55555"}
    assert mixed_up("The number is 12345.", "12345", codes) == set()
    assert mixed_up("It is 67890, or 12345", "12345", codes) == {"67890"}
    # years, longer numbers and numbers of no request are not mix-ups
    assert mixed_up("born 1987, id 123456, 99999", "12345", codes) == set()


def test_percentiles_match_numpy() -> None:
    rng = random.Random(0)
    xs = [rng.random() for _ in range(137)]
    for q in (0, 50, 90, 99, 100):
        assert load_stats.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert load_stats.percentile([], 50) is None and load_stats.percentile([3.0], 99) == 3.0


def _result(i: int, ok: bool = True, end: float = 0.0) -> dict:
    return {
        "ok": ok,
        "ttft_s": 0.1 * (i + 1) if ok else None,
        "gaps_s": [0.01, 0.03] if ok else [],
        "tokens": 3 if ok else 0,
        "mixed": ["99999"] if i == 2 else [],
        "own": i != 1,
        "end_s": end,
    }


def test_phase_summary_and_windows() -> None:
    results = [_result(i, ok=i != 4, end=float(i + 1)) for i in range(5)]
    s = load_stats.summarize_phase(results, wall_s=5.0)
    assert (s["completed"], s["errors"], s["mixed_up"], s["own_fact"]) == (4, 1, 1, 3)
    assert s["requests_per_s"] == pytest.approx(0.8)
    assert s["ttft_p50_s"] == pytest.approx(0.25) and s["itl_max_s"] == 0.03
    windows = load_stats.throughput_windows(results, 2)
    assert [(w["requests"], w["end_s"], w["requests_per_s"]) for w in windows] == [
        (2, 2.0, 1.0),
        (4, 4.0, 1.0),
    ]
    lines = [
        {"blended": True, "num_tokens": 100, "num_reusable": 80, "recomputed_reusable": 12}
        | {"blend_ms": 250.0},
        {"blended": False, "reason": "would not pay", "num_tokens": 100, "num_reusable": 0},
        {"blended": True, "num_tokens": 100, "num_reusable": 90, "fallback_reason": "x"},
    ]
    (w1, w2) = load_stats.stats_windows(lines, 2)
    assert w1["blended_share"] == 0.5 and w1["reused_share"] == pytest.approx(0.4)
    assert w2["found_share"] == pytest.approx(0.9)  # found, but the blend fell back
    assert w1["blend_s"] == 0.25 and w1["blend_ms_p50"] == 250.0 and w2["blend_ms_p50"] is None
    assert w1["left_to_vllm"] == {"would not pay": 1} and w1["recomputed_tokens"] == 12
    assert w2["requests"] == 3 and w2["blended_share"] == 0.0
    before = dict.fromkeys(load_stats.METRIC_COUNTERS, 0.0)
    after = {**before, "vllm:cacheblend_store_hits_total": 30.0}
    after.update({"vllm:cacheblend_store_misses_total": 10.0, "vllm:cacheblend_store_bytes": 7.0})
    m = load_stats.metric_window(before, after)
    assert m["store_hit_rate"] == 0.75 and m["store_bytes"] == 7.0
    assert m["reused_share_of_blended"] is None


def test_results_get_their_requests_stats_line_by_id() -> None:
    results = [_result(i) | {"response_id": f"chatcmpl-{i}"} for i in range(3)]
    lines = [
        {"req_id": "chatcmpl-0-1a2b3c4d", "blended": False, "reason": "would not pay"},
        {"req_id": "chatcmpl-1-9f8e7d6c", "blended": True, "num_reusable": 700, "blend_ms": 90},
        {"req_id": "other-5", "blended": True},
    ]
    load_stats.attach_lines(results, lines)
    assert results[0]["connector"]["reason"] == "would not pay"
    assert results[1]["connector"]["blended"] and results[1]["connector"]["blend_ms"] == 90
    assert "connector" not in results[2]
    split = load_stats.ttft_by_outcome(results)
    assert split["blended"]["requests"] == 1 and split["blended"]["ttft_p50_s"] == 0.2
    assert split["not_blended"]["ttft_p50_s"] == 0.1


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams the number of the note in the request, or another request's (``MIX``), word by
    word; remembers every body."""

    bodies: list[dict] = []
    mix: str | None = None

    def do_GET(self) -> None:  # /metrics, /v1/models
        text = b'vllm:cacheblend_store_hits_total{tier="cpu"} 4.0\n'
        if self.path == "/v1/models":
            text = json.dumps({"data": [{"id": "fake", "max_model_len": 4096}]}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(text)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        found = re.search(r"is (\d{5})\.", body["messages"][0]["content"])
        code = found.group(1) if found else "none"
        if type(self).mix and "badge 2?" in body["messages"][1]["content"]:
            code = type(self).mix
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in ["The", " number", " is", f" {code}."]:
            chunk = {"choices": [{"delta": {"content": word}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server():
    _FakeOpenAI.bodies = []
    _FakeOpenAI.mix = None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("rate", [None, 200.0])
def test_the_driver_streams_times_and_checks_every_answer(fake_server, rate) -> None:
    reqs = build_requests(corpus(10), 6, 3, 1.0)
    _FakeOpenAI.mix = reqs[3].code  # the answer to badge 2 holds badge 4's number
    spec = PhaseSpec("full prefill", params={"blend": False}, unique_salt=True)
    out = asyncio.run(
        run_phase(fake_server, "m", spec, reqs, clients=3, rate=rate, max_tokens=4, window=4)
    )
    results = out["results"]
    assert all(r["ok"] for r in results) and [r["index"] for r in results] == list(range(6))
    assert all(r["tokens"] == 4 and len(r["gaps_s"]) == 3 and r["ttft_s"] > 0 for r in results)
    assert [bool(r["mixed"]) for r in results] == [False, True, False, False, False, False]
    assert results[1]["mixed"] == [reqs[3].code] and not results[1]["own"]
    # snapshots at the start, after 4 requests and at the end
    assert [s["requests"] for s in out["snapshots"]] == [0, 4, 6]
    assert out["snapshots"][0]["vllm:cacheblend_store_hits_total"] == 4.0
    body = _FakeOpenAI.bodies[0]
    assert body["kv_transfer_params"] == {"blend": False} and body["stream"] is True
    assert len({b["cache_salt"] for b in _FakeOpenAI.bodies}) == 6


def test_request_bodies_per_phase() -> None:
    (req,) = build_requests(corpus(5), 1, 2, 1.0)
    blend = request_body(PhaseSpec("cacheblend"), req, "m", 32, "run")
    assert "kv_transfer_params" not in blend and "cache_salt" not in blend
    assert blend["max_tokens"] == 32 and blend["ignore_eos"] is True
    prefix = request_body(PhaseSpec("p", params={"blend": False}), req, "m", 32, "run")
    assert prefix["kv_transfer_params"] == {"blend": False} and "cache_salt" not in prefix


def test_a_run_against_a_url_writes_json_and_plots(fake_server, tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    load.add_arguments(parser, standalone=True)
    args = parser.parse_args(
        ["--url", fake_server, "--requests", "5", "--corpus-chunks", "8", "--k", "2"]
        + ["--phases", "prefix,blend", "--window", "2", "--no-progress"]
        + ["--json", str(tmp_path / "out.json"), "--plots", str(tmp_path)]
    )
    result = load.run(args)
    assert list(result["phases"]) == ["prefix caching", "cacheblend"]
    blend = result["phases"]["cacheblend"]
    assert blend["summary"]["completed"] == 5 and blend["summary"]["mixed_up"] == 0
    assert blend["stats"] is None  # no stats file with --url alone
    assert [w["requests"] for w in blend["throughput_windows"]] == [2, 4, 5]
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["phases"]["cacheblend"]["summary"]["requests"] == 5
    assert (tmp_path / "load_over_time.png").stat().st_size > 0
    assert (tmp_path / "ttft_distribution.png").stat().st_size > 0
    assert "cacheblend" in capsys.readouterr().out
    # the prefix phase opts out; the blend phase sends the server's defaults
    assert sum("kv_transfer_params" in b for b in _FakeOpenAI.bodies) == 1 + 5


def test_connector_keys_become_the_servers_kv_transfer_config() -> None:
    assert load.connector_args([]) == []
    flag, value = load.connector_args(["blend_layers_per_step=0", "selected_attention=vllm"])
    config = json.loads(value)
    assert flag == "--kv-transfer-config" and config["kv_connector"] == "CacheBlendConnector"
    assert config["kv_connector_extra_config"] == {
        "blend_layers_per_step": 0,
        "selected_attention": "vllm",
    }
    with pytest.raises(SystemExit, match="blend_layers_per_step"):
        load.connector_args(["blend_layers_per_step"])


def test_the_cached_phase_sends_one_prompt_every_time_opted_out(fake_server, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    load.add_arguments(parser, standalone=True)
    args = parser.parse_args(
        ["--url", fake_server, "--requests", "4", "--corpus-chunks", "8", "--k", "2"]
        + ["--phases", "cached", "--no-progress"]
    )
    result = load.run(args, out=open(tmp_path / "out.txt", "w"))
    cached = result["phases"]["prompt cached"]["summary"]
    assert cached["completed"] == 4 and cached["mixed_up"] == 0 and cached["own_fact"] == 4
    assert len({json.dumps(b["messages"]) for b in _FakeOpenAI.bodies[1:]}) == 1
    assert all(b["kv_transfer_params"] == {"blend": False} for b in _FakeOpenAI.bodies[1:])
    assert all("cache_salt" not in b for b in _FakeOpenAI.bodies)


def _real_server_args(argv: list[str]) -> argparse.Namespace:
    """``bench --load`` flags for a run against a started ``lmcache-backend serve`` (skips
    without vLLM or the embedded model)."""
    pytest.importorskip("vllm")
    try:
        from lmcache_backend.data.embedded import embedded_model_path

        embedded_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    parser = argparse.ArgumentParser()
    load.add_arguments(parser, standalone=True)
    return parser.parse_args(argv)


@pytest.mark.slow
def test_a_small_load_run_against_a_real_server(tmp_path) -> None:
    """Three phases of 8 requests from 4 clients through ``lmcache-backend serve``."""
    args = _real_server_args(
        ["--requests", "8", "--clients", "4", "--corpus-chunks", "6", "--k", "3", "--eager"]
        + ["--stream-tokens", "8", "--window", "4", "--no-progress", "--store-share", "0"]
        + ["--json", str(tmp_path / "load.json"), "--plots", str(tmp_path)]
    )
    result = load.run(args)
    phases = result["phases"]
    assert list(phases) == ["full prefill", "prefix caching", "cacheblend"]
    for p in phases.values():
        assert p["summary"]["completed"] == 8 and p["summary"]["errors"] == 0
        assert p["summary"]["mixed_up"] == 0
    assert phases["full prefill"]["stats"]["blended_share"] == 0
    # 6 chunks, 3 per request: most later requests find theirs in the store
    assert phases["cacheblend"]["stats"]["blended_share"] > 0
    assert phases["cacheblend"]["metrics"]["store_hits"] > 0
    assert (tmp_path / "load_over_time.png").exists()
    assert json.loads((tmp_path / "load.json").read_text())["phases"]


@pytest.mark.slow
def test_a_store_smaller_than_one_requests_chunks_loses_and_mixes_nothing(tmp_path) -> None:
    """A CPU store holding a tenth of the corpus (less than one request's three chunks), so
    that segments are refused and evicted while requests run: every request completes with its
    own number."""
    args = _real_server_args(
        ["--requests", "12", "--clients", "4", "--corpus-chunks", "10", "--k", "3", "--eager"]
        + ["--stream-tokens", "8", "--window", "4", "--no-progress", "--phases", "blend"]
        + ["--store-share", "0.1"]
    )
    result = load.run(args)
    summary = result["phases"]["cacheblend"]["summary"]
    assert summary["completed"] == 12 and summary["errors"] == 0 and summary["mixed_up"] == 0
    assert result["setup"]["server_env"]["LMCACHE_MAX_LOCAL_CPU_SIZE"]


#: /metrics as vLLM exposes it: HELP and TYPE lines, label values with spaces, commas and escaped
#: quotes, a counter whose name is another's prefix, _created samples, a histogram
METRICS_TEXT = r"""# HELP vllm:cacheblend_requests_total Requests the connector saw.
# TYPE vllm:cacheblend_requests_total counter
vllm:cacheblend_requests_total{engine="0",model_name="m",reason="opted out"} 3.0
vllm:cacheblend_requests_total{engine="0",model_name="m",reason="would not pay"} 2.0
vllm:cacheblend_requests_total{engine="1",model_name="a \"q\", odd} x",reason="opted out"} 4.0
vllm:cacheblend_requests_created{engine="0",model_name="m",reason="opted out"} 1.79e+09
# HELP vllm:cacheblend_requests_blended_total Requests blended.
# TYPE vllm:cacheblend_requests_blended_total counter
vllm:cacheblend_requests_blended_total{engine="0",model_name="m"} 7.0
# HELP vllm:cacheblend_store_bytes Bytes held.
# TYPE vllm:cacheblend_store_bytes gauge
vllm:cacheblend_store_bytes{tier="cpu"} 1.5e+06
vllm:cacheblend_store_bytes{tier="disk"} 0.0
# HELP vllm:time_to_first_token_seconds TTFT.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.35
"""


def test_metrics_are_summed_by_sample_name_and_labels() -> None:
    from lmcache_backend.integration.vllm.serving.process import metric_total, metric_totals

    assert metric_total(METRICS_TEXT, "vllm:cacheblend_requests_total") == 9.0
    assert metric_total(METRICS_TEXT, "vllm:cacheblend_requests_total", reason="opted out") == 7.0
    odd = metric_total(METRICS_TEXT, "vllm:cacheblend_requests_total", model_name='a "q", odd} x')
    assert odd == 4.0
    assert metric_total(METRICS_TEXT, "vllm:cacheblend_store_bytes", tier="cpu") == 1.5e6
    assert metric_total(METRICS_TEXT, "vllm:time_to_first_token_seconds_count") == 2.0
    counters = load_driver_counters(METRICS_TEXT)
    assert counters["vllm:cacheblend_requests_blended_total"] == 7.0
    assert counters["vllm:cacheblend_store_hits_total"] == 0.0  # absent: 0
    assert metric_totals("", ["x"]) == {"x": 0.0}


def load_driver_counters(text: str) -> dict[str, float]:
    from lmcache_backend.bench.load_test.driver import parse_metrics

    return parse_metrics(text)


def test_the_ingested_phase_pre_encodes_its_corpus_first(fake_server, tmp_path, monkeypatch):
    from lmcache_backend.bench.load_test import ingest as load_ingest

    calls = []

    def pre_encode(chunks, env, model, out):
        calls.append((list(chunks), dict(env), model, len(_FakeOpenAI.bodies)))
        return {"summary": "ingested", "seconds": 0.0}

    monkeypatch.setattr(load_ingest, "pre_encode", pre_encode)
    parser = argparse.ArgumentParser()
    load.add_arguments(parser, standalone=True)
    argv = ["--url", fake_server, "--requests", "3", "--corpus-chunks", "6", "--k", "2"]
    argv += ["--phases", "full,ingested", "--no-progress"]
    with pytest.raises(SystemExit, match="LMCACHE_REMOTE_URL"):
        load.run(parser.parse_args(argv), out=open(tmp_path / "out.txt", "w"))
    argv += ["--server-env", "LMCACHE_REMOTE_URL=redis://h:1"]
    result = load.run(parser.parse_args(argv), out=open(tmp_path / "out.txt", "w"))
    ((chunks, env, model, sent),) = calls
    assert chunks == corpus(6, seed=1) and env["LMCACHE_REMOTE_URL"] == "redis://h:1"
    assert sent == 1 + 3, "after the warm-up and the full phase, before its own requests"
    assert result["phases"]["pre-encoded corpus"]["ingest"]["summary"] == "ingested"


def test_a_started_server_starts_after_the_ingestion(fake_server, tmp_path, monkeypatch):
    """Without --url the corpus is encoded before the server starts: one engine at a time."""
    import contextlib

    from lmcache_backend.bench import server as bench_server
    from lmcache_backend.bench.load_test import ingest as load_ingest

    events = []

    def pre_encode(chunks, env, model, out):
        events.append(("ingest", chunks, model))
        return {"summary": "ingested", "seconds": 0.0}

    @contextlib.contextmanager
    def served(url, stats_file, vllm_args, env, out, prefix):
        events.append(("server", env["LMCACHE_REMOTE_URL"]))
        yield fake_server, None, None

    monkeypatch.setattr(load_ingest, "pre_encode", pre_encode)
    monkeypatch.setattr(bench_server, "bench_server", served)
    parser = argparse.ArgumentParser()
    load.add_arguments(parser, standalone=True)
    argv = ["--requests", "2", "--corpus-chunks", "6", "--k", "2", "--store-share", "0"]
    argv += ["--phases", "full,ingested", "--no-progress"]
    argv += ["--server-env", "LMCACHE_REMOTE_URL=redis://h:1"]
    result = load.run(parser.parse_args(argv), out=open(tmp_path / "out.txt", "w"))
    assert events == [("ingest", corpus(6, seed=1), None), ("server", "redis://h:1")]
    assert result["phases"]["pre-encoded corpus"]["ingest"]["summary"] == "ingested"


def test_the_bound_of_a_reuse_phase() -> None:
    from lmcache_backend.bench.load_test.ingest import bound_line, reuse_bound

    def phase(rps, p90, found=None, blend_s=0.0, done=100):
        stats = None if found is None else {"found_share": found}
        return {
            "summary": {"requests_per_s": rps, "ttft_p90_s": p90, "completed": done},
            "stats": stats,
            "stats_windows": [{"blend_s": blend_s * done}],
        }

    phases = {
        "full prefill": phase(1.6, 1.4),  # 0.625 s a request
        "prompt cached": phase(5.0, 0.1),  # 0.2 s of it no reuse removes
        "pre-encoded corpus": phase(2.5, 0.5, found=0.8, blend_s=0.1),
    }
    b = reuse_bound(phases, "pre-encoded corpus")
    floor = 0.2 + 0.2 * 0.425
    assert b["bound_found_rps"] == pytest.approx(1 / floor)
    assert b["bound_rps"] == pytest.approx(1 / (floor + 0.1))
    assert b["measured_over_bound"] == pytest.approx(2.5 * (floor + 0.1))
    assert b["speedup_vs_full"] == pytest.approx(2.5 / 1.6)
    assert b["ttft_p90_vs_full"] == pytest.approx(0.5 / 1.4)
    assert "measured/bound 0.96" in bound_line("pre-encoded corpus", b)
    del phases["prompt cached"]
    assert reuse_bound(phases, "pre-encoded corpus") is None


def test_ingested_chunks_are_found_in_the_load_requests() -> None:
    """The load requests hold a chunk after the stock system prompt or a blank line: the blocks
    ingest stores in its template are found there, all but up to a block at each edge."""
    from transformers import AutoTokenizer

    from lmcache_backend.bench.load_test.ingest import TEMPLATE
    from lmcache_backend.blend.segments.patterns import BlockPattern
    from lmcache_backend.commands.corpus import ChunkPrompt
    from lmcache_backend.data.embedded import embedded_model_path
    from lmcache_backend.models.fingerprint import ModelFingerprint
    from lmcache_backend.storage.segments import segment_keys

    try:
        tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    fp = ModelFingerprint("T", 1, 1, 1, 1, "r", "bf16", "w")
    pattern = BlockPattern(16)
    chunks = corpus(12)
    prompt = ChunkPrompt(messages=tuple((m["role"], m["content"]) for m in TEMPLATE["messages"]))
    stored = set()
    for chunk in chunks:
        ids = prompt.token_ids(tok, chunk)
        stored.update(segment_keys(fp, ids, [(u.start, u.end) for u in pattern.store_units(ids)]))
    a, b = (prompt.token_ids(tok, c) for c in chunks[:2])
    system = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the part before a chunk
    for req in build_requests(chunks, 4, 4, 1.0, seed=5):
        text = tok.apply_chat_template(req.messages(), tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)

        def held(segments, ids=ids):
            spans = [(s.start, s.end) for s in segments]
            return [k in stored for k in segment_keys(fp, ids, spans)]

        found = sum(len(s) for s in pattern.match(ids, held) if s.start >= system)
        docs = [chunks[i] for i in req.chunk_ids]
        chunk_tokens = sum(len(tok.encode(d, add_special_tokens=False)) for d in docs)
        assert 0.85 * chunk_tokens <= found <= chunk_tokens, (found, chunk_tokens)


def test_the_full_phase_neither_reuses_nor_stores() -> None:
    """Each full-prefill request carries a salt of its own: its K/V could never be found, and
    writing them (to a shared tier, megabytes a request) would slow only this phase."""
    full = load.PHASES["full"]
    assert full.params == {"blend": False, "lmcache.skip_save": True} and full.unique_salt
