"""The client benchmark's full prefills are full whatever the server's prefix caching: every
opted-out request of the LangChain and LlamaIndex shapes carries a ``cache_salt`` never sent
before (vLLM serves a salted request no block computed under another salt: the isolation itself
is run on a real server in tests/integration/vllm/test_vllm_server_tenants.py), and the blended
ones carry none.

The frameworks send to a loopback HTTP server that records each body and streams a short
answer in the OpenAI format (chat and completions)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmcache_backend.bench.frameworks.clients import CLIENTS, make_shape
from lmcache_backend.bench.frameworks.common import (
    FULL_PREFILL_NOTE,
    FULL_PREFILL_PARAMS,
    full_prefill_body,
)

FRAMEWORK_MODULES = {
    "langchain": ("langchain_core", "langchain_openai", "langchain_classic"),
    "llamaindex": ("llama_index.core", "llama_index.llms.openai_like"),
}


class _Recorder(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        chat = self.path.endswith("/chat/completions")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in ["Tom", " owns", " it."]:
            choice = {"index": 0, "finish_reason": None}
            choice.update(
                {"delta": {"role": "assistant", "content": word}} if chat else {"text": word}
            )
            chunk = {
                "id": "cmpl-1",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": "m",
                "choices": [choice],
            }
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recorder():
    _Recorder.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_a_full_prefill_body_opts_out_with_a_new_salt() -> None:
    a, b = full_prefill_body(), full_prefill_body()
    assert a["kv_transfer_params"] == {"blend": False, "lmcache.skip_save": True}
    assert a["kv_transfer_params"] == FULL_PREFILL_PARAMS
    assert a["cache_salt"] != b["cache_salt"]
    # vLLM accepts salts of at most 128 characters without '@', '/', '\\' or NUL
    assert len(a["cache_salt"]) <= 128 and not set(a["cache_salt"]) & set("@/\\\0")
    assert "cache_salt" in FULL_PREFILL_NOTE


@pytest.mark.parametrize("shape_name", CLIENTS["all"])
def test_every_full_prefill_request_has_a_salt_of_its_own(recorder, shape_name) -> None:
    for module in FRAMEWORK_MODULES[shape_name.split("-", 1)[0]]:
        pytest.importorskip(module)
    shape = make_shape(shape_name, recorder, "m", 8, 4096)
    docs = ["Alice lives in Paris.", "Bob owns a cat named Tom."]
    for blend in (False, True, False, False):
        answer = shape.ask(docs, "Who owns a cat?", blend)
        assert answer.text == "Tom owns it.", answer
    bodies = _Recorder.bodies
    assert len(bodies) == 4, bodies
    full = [b for i, b in enumerate(bodies) if i != 1]
    assert all(b["kv_transfer_params"] == FULL_PREFILL_PARAMS for b in full), full
    assert len({b["cache_salt"] for b in full}) == 3, full
    assert "cache_salt" not in bodies[1] and "kv_transfer_params" not in bodies[1], bodies[1]
