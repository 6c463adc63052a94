"""Sliced blends (``blend_layers_per_step``) behind vLLM's OpenAI server, over HTTP.

The server setup of ``test_vllm_server.py`` (fp32, prefix cache off, a KV cache too small for 8
concurrent prompts and their answers) with ``blend_layers_per_step: 4`` in the connector's
extra config: the blended prompts are loaded as vLLM asynchronous KV loads over several engine
steps, several of them queued at once, while vLLM preempts and resumes requests. Every client must
get an answer that holds its own invented number and no other client's, and the blends must
really have been spread over steps (``blend_steps`` in the stats file).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from test_vllm_server import (  # noqa: E402
    REQUEST_TIMEOUT_S,
    SERVER_ARGS,
    _check,
    _clients,
    _report,
)

from lmcache_backend.demos.server import RagClient, ServerProcess  # noqa: E402
from lmcache_backend.integration.vllm import kv_transfer_config  # noqa: E402

LAYERS_PER_STEP = 4
# Sliced loads stagger the requests, so fewer decode at once than in test_vllm_server.py: a
# smaller KV cache (48 blocks of 32 tokens, about two prompts) still makes vLLM preempt.
KV_BLOCKS = 48
ARGS = [*SERVER_ARGS]
ARGS[ARGS.index("--num-gpu-blocks-override") + 1] = str(KV_BLOCKS)
ARGS[ARGS.index("--max-model-len") + 1] = str((KV_BLOCKS - 2) * 32)  # vLLM keeps a block spare


@pytest.fixture(scope="module")
def model_path() -> str:
    try:
        from lmcache_backend.embedded import embedded_model_path

        return str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("server-sliced")
    stats = tmp / "blend.jsonl"
    kv = kv_transfer_config(str(stats), blend_layers_per_step=LAYERS_PER_STEP)
    srv = ServerProcess(
        [*ARGS, "--kv-transfer-config", json.dumps(kv)],
        env={"LMCACHE_BLEND_MIN_TOKENS": "32", "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15"},
        stats_file=stats,
        log_path=tmp / "server.log",
        model=model_path,
    )
    request.addfinalizer(srv.stop)
    srv.start(timeout_s=400)
    return srv


@pytest.fixture(scope="module")
def concurrent_run(server, model_path) -> dict:
    from transformers import AutoTokenizer

    from lmcache_backend.examples import builtin_examples

    rag = RagClient(
        server.client(REQUEST_TIMEOUT_S), model_path, AutoTokenizer.from_pretrained(model_path)
    )
    before = len(server.stats())
    run = _clients(server, rag, builtin_examples(2, chunks_per_example=4)[1], max_tokens=40)
    run["records"] = server.stats()[before:]
    _report(f"8 concurrent clients, blend_layers_per_step={LAYERS_PER_STEP}", run)
    return run


def test_sliced_blends_over_http_answer_each_client_with_its_own_facts(concurrent_run) -> None:
    _check(concurrent_run)


def test_blends_were_spread_over_engine_steps(concurrent_run) -> None:
    sliced = [r for r in concurrent_run["records"] if r.get("blend_steps", 1) > 1]
    # a 30-layer model with a preview: at least 60 layer passes, 4 a step
    assert len(sliced) >= 6, [r.get("blend_steps") for r in concurrent_run["records"]]
    assert min(r["blend_steps"] for r in sliced) >= 60 // LAYERS_PER_STEP


def test_preemption_with_sliced_loads_loses_no_request(server, concurrent_run) -> None:
    assert concurrent_run["preemptions"] >= 1, "the KV cache was meant to be too small"
    assert concurrent_run["answers"] == 16 and not concurrent_run["mixed"]
    assert server.alive()
