"""Tenants behind the OpenAI server: ``cache_salt`` isolation, an authenticated Redis tier shared
by two engines, the private index folder, and random requests, over HTTP.

Two ``lmcache-backend serve`` engines share one real ``redis-server`` and one shared secret
(``extra_config.shared_secret_file``). Engine A runs first: two tenants (salts) send the same
documents, and each reuses only what it stored itself; then random and malformed requests
(``hypothesis``, :mod:`http_fuzz`) each get a 4xx or a well-formed answer, and a control request
answers the same before and after them; then SIGTERM stops it and its index folder must be gone.
Engine B starts next, on the Redis entries engine A left: each tenant reuses its own entries from
there and no one else's, and entries planted by a writer without the secret are never loaded.

fp32 (answers compared for equality), vLLM's prefix cache on (the default: vLLM isolates salts
there too). TTFT of the two-tenant run is printed (``-s``); docs/security.md records it.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")
pytest.importorskip("hypothesis")

import http_fuzz  # noqa: E402
import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from redis_deployments import write_secret_file  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from test_vllm_server import embedded_model_or_skip, rag_client, start_server  # noqa: E402

from lmcache_backend.data.examples import builtin_examples, reordered  # noqa: E402
from lmcache_backend.demos.server import longer  # noqa: E402
from lmcache_backend.integration.vllm import kv_transfer_config  # noqa: E402
from lmcache_backend.storage.lookup.index_dir import OWNER_FILE, default_index_dir  # noqa: E402

ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2400", "--max-num-seqs", "4"]
SECRET = b"tenants-test-secret-0123456789abcdef"
FUZZ_EXAMPLES = 60
# three examples of five documents: ~880-token prompts (the report's had ~1,100)
EXAMPLES = builtin_examples(3, chunks_per_example=5)


def _engine(request, tmp_path_factory, name: str, redis_url: str, secret_file: str):
    instance = f"tenants-{name}-{os.getpid()}"
    kv = kv_transfer_config(instance_id=instance)
    env = {
        "LMCACHE_REMOTE_URL": redis_url,
        "LMCACHE_EXTRA_CONFIG": json.dumps({"shared_secret_file": secret_file}),
    }
    tmp = tmp_path_factory.mktemp(f"engine-{name}")
    args = [*ARGS, "--kv-transfer-config", json.dumps(kv)]
    srv = start_server(request, tmp, embedded_model_or_skip(), args, env)
    srv.index_dir = default_index_dir(instance)
    return srv


@pytest.fixture(scope="module")
def redis_url(request):
    srv = RedisServer()
    srv.start()
    request.addfinalizer(srv.stop)
    return srv.url


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    return write_secret_file(tmp_path_factory.mktemp("secret"), SECRET)


@pytest.fixture(scope="module")
def engine_a(request, tmp_path_factory, redis_url, secret_file):
    return _engine(request, tmp_path_factory, "a", redis_url, secret_file)


@pytest.fixture(scope="module")
def rag_a(engine_a):
    return rag_client(engine_a, embedded_model_or_skip())


def _ask(server, rag, example, docs, salt, question=None):
    """One streamed request; returns (reply, the blend records it added)."""
    before = len(server.stats())
    reply = rag.ask(example.system, docs, question or example.question, 8, cache_salt=salt)
    return reply, server.stats()[before:]


def _docs(example):
    return longer(example.chunks, 1)


def test_two_tenants_reuse_only_their_own_segments(engine_a, rag_a) -> None:
    """Tenant A stores its documents; tenant B sends them reordered under its own salt: nothing
    is reused (before salts were keys, 1,092 of ~1,117 tokens were). Each reuses its own."""
    ttft: dict[str, list[float]] = {"A first": [], "B, another salt": [], "A again": []}
    for i, ex in enumerate(EXAMPLES):
        # new tenants per example: the examples share their system prompt, a segment too
        a, b = f"tenant-A-{i}", f"tenant-B-{i}"
        docs = _docs(ex)
        first, records = _ask(engine_a, rag_a, ex, docs, a)
        assert records == [], "nothing was cached yet"
        other, records = _ask(engine_a, rag_a, ex, reordered(docs, i + 1), b)
        assert records == [], f"tenant B reused tenant A's segments: {records}"
        again, records = _ask(engine_a, rag_a, ex, reordered(docs, i + 2), a)
        (record,) = records
        n = len(rag_a.prompt(ex.system, docs, ex.question))
        assert record["salted"] and record["num_reusable"] >= 0.8 * n, record
        # tenant B reuses what its own first request stored
        _, records = _ask(engine_a, rag_a, ex, reordered(docs, i + 3), b)
        assert len(records) == 1 and records[0]["num_reusable"] >= 0.8 * n, records
        ttft["A first"].append(first.ttft_s)
        ttft["B, another salt"].append(other.ttft_s)
        ttft["A again"].append(again.ttft_s)
    medians = {k: statistics.median(v) for k, v in ttft.items()}
    print(f"\nTTFT medians (s), {len(EXAMPLES)} examples: {medians}")
    # tenant B's time looks like a full prefill, not like a hit on tenant A's documents
    assert medians["B, another salt"] > medians["A again"], ttft


def test_unsalted_requests_share_among_themselves_only(engine_a, rag_a) -> None:
    ex = EXAMPLES[0]
    docs = _docs(ex)
    _, records = _ask(engine_a, rag_a, ex, docs, None)
    assert records == [], "salted entries are not an unsalted request's"
    _, records = _ask(engine_a, rag_a, ex, reordered(docs, 1), None)
    assert len(records) == 1 and not records[0]["salted"], records
    before = len(engine_a.stats())
    rag_a.ask(ex.system, reordered(docs, 2), ex.question, 4, params={"blend": False})
    assert engine_a.stats()[before:] == [], "the per-request opt-out still holds"


# -- random and malformed requests --------------------------------------------------------------

FUZZ_DOCS = [
    "# Record of Ilse Varn. Ilse Varn keeps bees in Oldport and sells honey on Fridays.",
    "# Record of Tomas Brea. Tomas Brea repairs clocks and owns a grey cat called Pim.",
    "# Record of Ona Reyes. Ona Reyes rows on the river every morning before work.",
]
FUZZ_COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def http(engine_a):
    with httpx.Client(base_url=engine_a.base_url + "/v1", timeout=240) as client:
        yield client


def _send(http, case: http_fuzz.Case) -> tuple[int, object]:
    path = "/chat/completions" if case.endpoint == "chat" else "/completions"
    resp = http.post(path, content=case.payload(), headers={"content-type": "application/json"})
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    return resp.status_code, body


def _control(http, model: str) -> str:
    """A salted RAG request over the fuzz documents, blended: its answer and its record."""
    content = "".join(" # # " + d for d in reversed(FUZZ_DOCS)) + " # # Who keeps bees?"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        "cache_salt": "control",
    }
    resp = http.post("/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def control_before(engine_a, http):
    model = embedded_model_or_skip()
    warm = "".join(" # # " + d for d in FUZZ_DOCS) + " # # Which names appear?"
    body = {"model": model, "messages": [{"role": "user", "content": warm}], "max_tokens": 1}
    assert http.post("/chat/completions", json={**body, "cache_salt": "control"}).status_code == 200
    before = len(engine_a.stats())
    text = _control(http, model)
    return text, engine_a.stats()[before:]


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,  # one request takes 0.1-10 s on a loaded 2-core machine
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_random_requests_get_a_4xx_or_an_answer(engine_a, http, control_before, data) -> None:
    model, vocab = embedded_model_or_skip(), 49152
    case = data.draw(
        http_fuzz.chat_cases(FUZZ_DOCS, model)
        | http_fuzz.token_cases(vocab, model)
        | http_fuzz.raw_cases(model)
    )
    if case.salt == http_fuzz.FRESH:  # a salt no request had before
        FUZZ_COUNTS["fresh salts"] = FUZZ_COUNTS.get("fresh salts", 0) + 1
        case.body["cache_salt"] = f"fresh-{FUZZ_COUNTS['fresh salts']}"
    before = len(engine_a.stats())
    status, body = _send(http, case)
    http_fuzz.check_answer(case, status, body)
    assert engine_a.alive(), engine_a.log_tail()
    salt = case.salt
    if status == 200 and isinstance(salt, str) and salt.startswith("fresh-"):
        assert engine_a.stats()[before:] == [], "a salt never seen before reused nothing"
    for label in case.labels or ["plain"]:
        FUZZ_COUNTS[label] = FUZZ_COUNTS.get(label, 0) + 1
    FUZZ_COUNTS["cases"] = FUZZ_COUNTS.get("cases", 0) + 1
    FUZZ_COUNTS[str(status)] = FUZZ_COUNTS.get(str(status), 0) + 1


def test_later_requests_are_unaffected_by_the_random_ones(engine_a, http, control_before) -> None:
    print(f"\nserver fuzz cases: {FUZZ_COUNTS}")
    assert FUZZ_COUNTS.get("cases", 0) >= FUZZ_EXAMPLES // 2, FUZZ_COUNTS
    text, records = control_before
    before = len(engine_a.stats())
    assert _control(http, embedded_model_or_skip()) == text
    after = engine_a.stats()[before:]
    assert len(records) == len(after) == 1
    for key in ("num_tokens", "claimed", "num_reusable", "recomputed_reusable"):
        assert after[0][key] == records[0][key], (records, after)
    assert "Traceback" not in engine_a.log_text()


# -- the index folder ---------------------------------------------------------------------------


def test_index_folder_is_private_to_its_owner(engine_a) -> None:
    folder = engine_a.index_dir
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert os.stat(os.path.dirname(os.path.dirname(folder))).st_mode & 0o777 == 0o700
    markers = [n for n in os.listdir(folder) if n != OWNER_FILE]
    assert markers, "the worker keeps markers of the segments it holds"
    assert all(os.stat(os.path.join(folder, n)).st_mode & 0o777 == 0o600 for n in markers)
    pid = int(open(os.path.join(folder, OWNER_FILE)).read().split()[0])
    assert pid != engine_a.proc.pid  # the worker process owns it, not the API server


def test_sigterm_removes_the_index_folder(engine_a) -> None:
    engine_a.stop()  # SIGTERM to the server's process group, as a service manager does
    assert not os.path.exists(engine_a.index_dir), os.listdir(engine_a.index_dir)


# -- a second engine on the same Redis ------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_b(request, tmp_path_factory, redis_url, secret_file, engine_a):
    engine_a.stop()  # one engine at a time on two cores: B finds A's entries in Redis
    return _engine(request, tmp_path_factory, "b", redis_url, secret_file)


@pytest.fixture(scope="module")
def rag_b(engine_b):
    return rag_client(engine_b, embedded_model_or_skip())


def test_second_engine_reuses_each_tenants_own_entries_from_redis(engine_b, rag_b) -> None:
    ex = EXAMPLES[0]
    docs = _docs(ex)
    n = len(rag_b.prompt(ex.system, docs, ex.question))
    for salt in ("tenant-A-0", "tenant-B-0"):
        _, records = _ask(engine_b, rag_b, ex, reordered(docs, 4), salt, "Who is oldest?")
        assert len(records) == 1 and records[0]["num_reusable"] >= 0.8 * n, (salt, records)
    _, records = _ask(engine_b, rag_b, ex, reordered(docs, 4), "tenant-C-0", "Who is oldest?")
    assert records == [], "a third tenant finds nothing of the other two in Redis"
    assert "refusing segment" not in engine_b.log_text()


def _forge_every_entry(redis_url: str) -> int:
    """Overwrite every Redis entry with zeros, well-formed and checksummed, as a writer without
    the secret can: half with a tag of another secret, half with none."""
    import redis
    import torch

    from lmcache_backend.storage.remote.auth import MAGIC, TAG_BYTES, EntryAuth
    from lmcache_backend.storage.segments import SegmentKV
    from lmcache_backend.storage.serde import _parse_header, decode, encode

    client = redis.Redis.from_url(redis_url)
    wrong = EntryAuth(b"not-the-secret-0123456789abcdef")
    keys = sorted(client.keys("lmcache_backend:segment:*"))
    for i, rkey in enumerate(keys):
        entry = client.get(rkey)[len(MAGIC) + TAG_BYTES :]
        meta = _parse_header(entry)[1]["__metadata__"]
        kv = decode(entry, meta["key"], None)
        zeros = SegmentKV(torch.zeros_like(kv.keys), torch.zeros_like(kv.values), 0)
        forged = encode(meta["key"], zeros, meta["fingerprint"])
        client.set(rkey, wrong.seal(meta["key"], forged) if i % 2 else forged)
    client.close()
    return len(keys)


def _valid_entries(redis_url: str) -> int:
    import redis

    from lmcache_backend.storage.remote.auth import AuthenticationError, EntryAuth

    client, auth, valid = redis.Redis.from_url(redis_url), EntryAuth(SECRET), 0
    for rkey in client.keys("lmcache_backend:segment:*"):
        key = rkey.decode().rsplit(":", 1)[1].strip("{}")  # <prefix>{<key>}: a hash tag
        try:
            auth.open(key, client.get(rkey))
            valid += 1
        except AuthenticationError:
            pass
    client.close()
    return valid


def test_entries_planted_without_the_secret_are_never_loaded(engine_b, rag_b, redis_url) -> None:
    """Every entry engine B does not hold locally yet is replaced by a forged one; the tenant's
    request then reuses nothing from Redis, the refusals are logged, engine B's own
    computations replace every forged entry it refused within that request, and its next
    request reuses them."""
    assert _forge_every_entry(redis_url) > 10
    assert _valid_entries(redis_url) == 0
    ex = EXAMPLES[1]  # stored by engine A; engine B never loaded it
    _, records = _ask(engine_b, rag_b, ex, reordered(_docs(ex), 3), "tenant-A-1", "Who?")
    # claimed (the keys exist) but nothing from the store reused: vLLM's prefix cache at most
    assert all(r["num_reusable"] <= r["prefix_len"] for r in records), records
    refused = engine_b.log_text().count("refusing segment")
    assert refused >= 5
    assert _valid_entries(redis_url) == refused, "each refused entry replaced by B's own"
    _, records = _ask(engine_b, rag_b, ex, reordered(_docs(ex), 4), "tenant-A-1", "Where?")
    n = len(rag_b.prompt(ex.system, _docs(ex), "Where?"))
    assert len(records) == 1 and records[0]["num_reusable"] >= 0.8 * n, records


def test_sigterm_to_the_server_process_removes_the_index_folder(engine_b) -> None:
    assert os.path.isdir(engine_b.index_dir)
    os.kill(engine_b.proc.pid, signal.SIGTERM)  # the server process alone, as kill(1) does
    engine_b.proc.wait(timeout=120)
    deadline = time.monotonic() + 30
    while os.path.exists(engine_b.index_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not os.path.exists(engine_b.index_dir)
