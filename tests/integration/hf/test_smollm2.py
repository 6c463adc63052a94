"""CacheBlend on the embedded real model, SmolLM2-135M-Instruct (fp32, CPU)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from lmcache_backend.blend.segmenting import build_blend_prompt
from lmcache_backend.config import load_config
from lmcache_backend.data.examples import builtin_examples, reordered
from lmcache_backend.storage.segments import SegmentKV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from lmcache_backend.data.embedded import load_embedded_model
    from lmcache_backend.integration.hf.engine import HFBlendEngine

    torch.set_num_threads(2)
    model, tokenizer = load_embedded_model()
    config = load_config(env={}, enable_blending=True, blend_check_layers=[1])
    return HFBlendEngine(model, tokenizer, config)


@pytest.fixture(scope="module")
def prompts(engine):
    """(first, second) token ids of the first four built-in examples; the store holds `first`."""
    out = []
    for example in builtin_examples(count=4):
        first = build_blend_prompt(
            engine.tokenizer, example.system, example.chunks, example.question
        )
        second = build_blend_prompt(
            engine.tokenizer, example.system, reordered(example.chunks), example.question
        )
        engine.warm(first.token_ids)
        out.append((first.token_ids, second.token_ids))
    return out


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def test_ratio_one_matches_full_prefill(engine, prompts) -> None:
    _, second = prompts[0]
    full = engine.full_prefill(second)
    blended = engine.blend_prefill(second, [1.0])
    assert blended.blend.blended
    assert blended.blend.recomputed.numel() == len(second)
    torch.testing.assert_close(blended.logits, full.logits, rtol=0, atol=1e-3)


def test_cacheblend_is_closer_to_full_prefill_than_naive_reuse(engine, prompts) -> None:
    """First-token KL from full prefill, averaged over four examples: CacheBlend at 15% beats
    naive reuse. (On a 135M model it does not close the gap; see docs/quality.md.)"""
    kl_blend, kl_naive = [], []
    for _, second in prompts:
        full = engine.full_prefill(second).logits
        kl_blend.append(_kl(full, engine.blend_prefill(second, [0.15]).logits))
        kl_naive.append(_kl(full, engine.blend_prefill(second, [0.0]).logits))
    mean_blend = sum(kl_blend) / len(kl_blend)
    mean_naive = sum(kl_naive) / len(kl_naive)
    print(f"KL per example: blend 0.15 {kl_blend}, naive {kl_naive}")
    assert mean_naive > 0  # reordering really changes something
    assert mean_blend < mean_naive


def test_recompute_ratio_counts(engine, prompts) -> None:
    _, second = prompts[1]
    result = engine.blend_prefill(second, [0.15]).blend
    assert result.blended
    uncached = len(second) - result.num_reusable
    selected = int(0.15 * result.num_reusable)
    # the last token is always recomputed: one more when it was cached and not selected
    forced_last = int(bool(result.valid_mask[-1]))
    assert result.recomputed.numel() in (selected + uncached, selected + uncached + forced_last)
    assert int(result.recomputed[-1]) == len(second) - 1
    assert result.recomputed_reusable in (selected, selected + forced_last)


def test_blended_generation_produces_text(engine, prompts) -> None:
    _, second = prompts[2]
    generation = engine.generate(second, "blend", [0.15], max_new_tokens=12)
    assert generation.token_ids and generation.text.strip()
    assert generation.prefill.blend.blended


def test_blended_prompt_stores_new_chunks_never_the_question(engine, prompts) -> None:
    example = builtin_examples(count=4)[3]
    new_chunk = "Ottoline Vance keeps bees on a roof in the harbour town of Saltmere."
    second = build_blend_prompt(
        engine.tokenizer,
        example.system,
        reordered(example.chunks, 1) + [new_chunk],
        "Which profile mentions a band?",
    ).token_ids
    prefill = engine.blend_prefill(second, [0.15])
    segments = engine.segment_cache.segments(second)
    keys = [engine.segment_cache.key(second, seg) for seg in segments]
    before = [engine.store.contains(k) for k in keys]
    # system part and the four known chunks cached; the new chunk and the question not
    assert before == [True] * (len(keys) - 2) + [False, False]
    stored = engine.store_prompt(second, prefill)
    assert stored == 1 and engine.store.contains(keys[-2])
    assert not engine.store.contains(keys[-1])  # the question is never stored


def test_tenants_with_different_salts_share_nothing(engine, prompts) -> None:
    """The HF engine takes vLLM's ``cache_salt``: a tenant's stored chunks are reused by that
    tenant only, and what a salted request stores stays under its salt."""
    first, second = prompts[1]  # the store holds `first` unsalted
    engine.warm(first, cache_salt="tenant-A")
    reused = engine.blend_prefill(second, [0.15], cache_salt="tenant-A").blend
    assert reused.blended and reused.num_reusable > 0
    other = engine.blend_prefill(second, [0.15], cache_salt="tenant-B").blend
    assert other.num_reusable == 0
    generation = engine.generate(second, "blend", [0.15], 4, cache_salt="tenant-B")
    assert generation.prefill.blend.num_reusable == 0
    # tenant B's full prefill stores under B: A's entries and the unsalted ones are untouched
    assert engine.store_prompt(second, engine.full_prefill(second), cache_salt="tenant-B") > 0
    salted_b = engine.segment_cache.salted("tenant-B")
    assert all(held for _, held in salted_b.cached(second))
    assert engine.blend_prefill(second, [0.15], cache_salt="tenant-B").blend.num_reusable > 0


def test_cached_question_is_still_recomputed(engine, prompts) -> None:
    """A question an earlier prompt held (even stored by hand) is never served from the store."""
    first, second = prompts[0]
    segments = engine.segment_cache.segments(second)
    tail = segments[-1]
    full = engine.full_prefill(second)
    engine.segment_cache.store.put(
        engine.segment_cache.key(second, tail),
        SegmentKV(
            keys=torch.stack([k[tail.start : tail.end] for k in full.keys]),
            values=torch.stack([v[tail.start : tail.end] for v in full.values]),
            start_position=tail.start,
        ),
    )
    result = engine.blend_prefill(second, [0.15]).blend
    assert result.blended
    assert not bool(result.valid_mask[tail.start :].any())
    assert set(range(tail.start, len(second))) <= set(result.recomputed.tolist())


def test_demo_prints_table_and_json(tmp_path) -> None:
    from lmcache_backend.demos.hf import run_demo

    out = io.StringIO()
    result = run_demo(repeats=1, max_new_tokens=4, out=out)
    text = out.getvalue()
    assert text.rstrip().splitlines()[-1].startswith("CacheBlend speedup over full prefill: ")
    names = [row["name"] for row in result["strategies"]]
    assert names == ["full prefill", "CacheBlend r=0.15", "naive reuse r=0"]
    for row in result["strategies"]:
        assert row["ttft_ms"] > 0 and row["speedup"] > 0
    json.dumps(result)  # what --json writes is serialisable


def test_separator_free_chat_messages(engine) -> None:
    """No separator: each document its own chat message; the documents reordered are found at
    their new offsets, the question message is computed."""
    from lmcache_backend.integration.hf.engine import HFBlendEngine

    config = load_config(env={}, enable_blending=True, blend_special_str="", blend_min_tokens=32)
    free = HFBlendEngine(engine.model, engine.tokenizer, config)
    tok = free.tokenizer
    example = builtin_examples(count=1)[0]

    def ids(chunks, question):
        messages = [{"role": "system", "content": example.system}]
        messages += [{"role": "user", "content": c} for c in chunks]
        messages += [{"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    first = ids(example.chunks, example.question)
    assert free.warm(first) > 0
    second = ids(reordered(example.chunks), example.question)
    blended = free.blend_prefill(second, [1.0])
    result = blended.blend
    assert result.blended and result.num_reusable > 0.5 * len(second)
    tail = free.segment_cache.query_start(second)
    assert not result.valid_mask[tail:].any() and result.valid_mask[:tail].any()
    full = free.full_prefill(second)
    torch.testing.assert_close(blended.logits, full.logits, rtol=0, atol=1e-3)
