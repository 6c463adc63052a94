"""Sliced blends (``blend_layers_per_step``) behind vLLM's OpenAI server, over HTTP.

The server setup of ``test_vllm_server.py`` (fp32, prefix cache off, a KV cache too small for 8
concurrent prompts and their answers) with ``blend_layers_per_step: 4`` in the connector's
extra config: the blended prompts are loaded as vLLM asynchronous KV loads over several engine
steps, several of them queued at once, while vLLM preempts and resumes requests. Every client must
get an answer that holds its own invented number and no other client's, and the blends must
really have been spread over steps (``blend_steps`` in the stats file). The connector config is
given on the command line, so the stats file reaches it through ``serve --stats-file``.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from test_vllm_server import (  # noqa: E402
    SERVER_ARGS,
    _check,
    _clients_until_preempted,
    _report,
    embedded_model_or_skip,
    rag_client,
    rag_example,
    start_server,
)

from lmcache_backend.integration.vllm import kv_transfer_config  # noqa: E402

LAYERS_PER_STEP = 4
# Sliced loads stagger the requests, so fewer decode at once than in test_vllm_server.py: a
# smaller KV cache (48 blocks of 32 tokens, about two prompts) still makes vLLM preempt.
KV_BLOCKS = 48
ARGS = [*SERVER_ARGS]
ARGS[ARGS.index("--num-gpu-blocks-override") + 1] = str(KV_BLOCKS)
ARGS[ARGS.index("--max-model-len") + 1] = str((KV_BLOCKS - 2) * 32)  # vLLM keeps a block spare


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    # the serve command adds its stats file to this connector config
    kv = kv_transfer_config(blend_layers_per_step=LAYERS_PER_STEP)
    args = [*ARGS, "--kv-transfer-config", json.dumps(kv)]
    tmp = tmp_path_factory.mktemp("server-sliced")
    return start_server(request, tmp, embedded_model_or_skip(), args)


@pytest.fixture(scope="module")
def concurrent_run(server) -> dict:
    rag = rag_client(server, embedded_model_or_skip())
    before = len(server.stats())
    run = _clients_until_preempted(server, rag, rag_example(), max_tokens=40)
    run["records"] = server.stats()[before:]
    _report(f"8 concurrent clients, blend_layers_per_step={LAYERS_PER_STEP}", run)
    return run


def test_sliced_blends_over_http_answer_each_client_with_its_own_facts(concurrent_run) -> None:
    _check(concurrent_run)


def test_blends_were_spread_over_engine_steps(concurrent_run) -> None:
    sliced = [r for r in concurrent_run["records"] if r.get("blend_steps", 1) > 1]
    # a 30-layer model: the preview through vLLM's forward (a step of its own), 4 layers a step
    assert len(sliced) >= 6, [r.get("blend_steps") for r in concurrent_run["records"]]
    assert min(r["blend_steps"] for r in sliced) >= 1 + 30 // LAYERS_PER_STEP


def test_preemption_with_sliced_loads_loses_no_request(server, concurrent_run) -> None:
    assert concurrent_run["preemptions"] >= 1, "the KV cache was meant to be too small"
    assert concurrent_run["answers"] == 16 * concurrent_run["rounds"]
    assert not concurrent_run["mixed"]
    assert server.alive()
