"""Staleness the blend can see: each token's staleness from its segment's provenance and
stored prior, the staleness-aware preview selection, the divergence estimate and its knob."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import C1, C2, C3, Q1, Q2, SEP, SYS, rag_prompt, setup_blender, tiny_model, warm_store

from lmcache_backend.blend.selectors.staleness import (
    count_for_divergence,
    divergence,
    relative_prior,
    token_staleness,
)
from lmcache_backend.config import ConfigError, load_config

SYS_N, C1_N, C2_N, C3_N = (len(x) + len(SEP) for x in (SYS, C1, C2, C3))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_the_prior_counts_each_layer_relative_to_its_mean():
    # two layers on very different scales; tokens 2..4 have a prior, the others none
    prior = torch.tensor([[1.0, 2.0, 3.0], [100.0, 100.0, 400.0]])
    out = relative_prior([(2, prior)], 7)
    # layer 0: 1, 2, 3 over mean 2; layer 1: 100, 100, 400 over mean 200; halves summed
    expected = torch.tensor([0.5 + 0.5, 1.0 + 0.5, 1.5 + 2.0]) / 2
    assert torch.allclose(out[2:5], expected)
    assert out[[0, 1, 5, 6]].tolist() == [1.0] * 4
    assert float(out[2:5].mean()) == pytest.approx(1.0)


def test_divergence_and_the_count_that_brings_it_under_a_bound():
    shares = torch.tensor([0.0, 0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    stale = torch.tensor([0.0, 0.5, 1.0, 1.0, 0.0])
    candidates = torch.tensor([False, True, True, True, True])
    # stale reads: 0.2 + 0.3 + 0.2 = 0.7
    assert divergence(shares, stale, torch.zeros(5, dtype=torch.bool)) == pytest.approx(0.7)
    assert divergence(shares, stale, candidates) == 0.0
    ranking = torch.tensor([9.0, 4.0, 3.0, 2.0, 1.0])  # tokens 1, 2, 3, 4 in that order
    # after token 1: 0.5, after 2: 0.2, after 3: 0.0
    assert count_for_divergence(shares, stale, ranking, candidates, 0.5, 1, 4) == 1
    assert count_for_divergence(shares, stale, ranking, candidates, 0.49, 1, 4) == 2
    assert count_for_divergence(shares, stale, ranking, candidates, 0.1, 1, 4) == 3
    assert count_for_divergence(shares, stale, ranking, candidates, 0.1, 1, 2) == 2  # the cap
    assert count_for_divergence(shares, stale, ranking, candidates, 0.9, 3, 4) == 3  # the ratio


def _stores_c2_alone_and_c3_after_sys_c1_c2(llama, cache):
    warm_store(llama, cache, rag_prompt(SYS, C2, Q1))  # C2 computed after SYS alone
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))  # stores C1 and C3 (C2 is held)


def test_staleness_is_zero_for_exact_segments_and_the_context_distance_else(llama):
    blender, cache = setup_blender(llama, selection="query_preview_stale")
    _stores_c2_alone_and_c3_after_sys_c1_c2(llama, cache)
    tokens = rag_prompt(SYS, C1, C2, C3, Q2)
    meta = blender.start_request(tokens)
    assert meta.exact_prefix == SYS_N + C1_N  # SYS and C1, as a full prefill computes them
    stale = token_staleness(meta, torch.device("cpu"))
    c2 = slice(SYS_N + C1_N, SYS_N + C1_N + C2_N)
    assert stale[: SYS_N + C1_N].eq(0).all()
    assert stale[c2].eq(0.5).all()  # computed after {SYS}, now after {SYS, C1}
    assert stale[c2.stop : c2.stop + C3_N].eq(0).all()  # exact, though after a stale one
    assert stale[c2.stop + C3_N :].eq(0).all()  # the question: not reused
    # with a stored prior, C2's tokens are weighted by it (relative to its own mean here)
    hit = next(kv for start, kv in meta.task.hits if start == c2.start)
    hit.staleness = torch.linspace(1.0, 3.0, C2_N).repeat(llama.config.num_hidden_layers, 1)
    weighted = token_staleness(meta, torch.device("cpu"))[c2]
    assert weighted[0] < 0.5 < weighted[-1] and float(weighted.mean()) == pytest.approx(0.5)


def test_the_stale_selection_spends_nothing_on_exact_segments_anywhere(llama):
    """``query_preview_stale`` never recomputes the exact C3 after the stale C2 while a stale
    token is left; ``query_preview_last`` (reads alone) recomputes some of C3, which the
    question, right after it, reads most."""
    tokens = rag_prompt(SYS, C1, C2, C3, Q2)
    c3 = torch.arange(SYS_N + C1_N + C2_N, SYS_N + C1_N + C2_N + C3_N)
    chosen = {}
    for selection in ("query_preview_stale", "query_preview_last"):
        blender, cache = setup_blender(llama, selection=selection, ratios=(0.2,))
        _stores_c2_alone_and_c3_after_sys_c1_c2(llama, cache)
        result = blender.blend(tokens)
        assert result.blended and result.divergence is not None
        reused = result.recomputed[result.valid_mask[result.recomputed]]
        assert reused.numel() == int(0.2 * result.num_reusable)
        chosen[selection] = set(reused.tolist())
    assert not chosen["query_preview_stale"] & set(c3.tolist())
    assert chosen["query_preview_last"] & set(c3.tolist())


def test_the_divergence_knob_recomputes_until_the_estimate_is_under_it(llama):
    tokens = rag_prompt(SYS, C2, C3, C1, Q2)
    results = {}
    for bound in (0.0, 0.05, 1e-9):
        blender, cache = setup_blender(llama, selection="query_preview_stale", ratios=(0.1,))
        for chunk in (C1, C2, C3):  # encoded alone, as lmcache-backend ingest stores them
            warm_store(llama, cache, rag_prompt(SYS, chunk, Q1))
        config = blender.config.replace(blend_max_divergence=bound, blend_max_recompute_ratio=0.6)
        results[bound] = blender.blend(tokens, config=config)
    base, bounded, capped = results[0.0], results[0.05], results[1e-9]
    assert base.divergence > 0.05 >= bounded.divergence
    assert base.recomputed.numel() < bounded.recomputed.numel() < capped.recomputed.numel()
    # the tightest bound stops at the cap: 60% of the reusable tokens
    assert capped.recomputed_reusable == int(0.6 * capped.num_reusable)
    assert capped.divergence > 0.0 or capped.recomputed_reusable < capped.num_reusable


def test_the_divergence_knob_needs_a_preview_selection():
    with pytest.raises(ConfigError, match="blend_max_divergence"):
        load_config(env={}, blend_max_divergence=0.1, blend_selection="kv_deviation")
    with pytest.raises(ConfigError, match="blend_max_divergence"):
        load_config(env={}, blend_max_divergence=-0.1)


def _entry_of(cache, chunk):
    """The stored entry of ``chunk`` encoded alone after the system part."""
    alone = rag_prompt(SYS, chunk, Q1)
    return cache.store.get(cache.key(alone, cache.segments(alone)[1]))


def test_a_probe_gives_each_stored_chunk_its_measured_prior(llama):
    """Two staleness probes (each chunk computed after other text) give each chunk stored alone
    the mean of the two measured deviations: keys re-rotated to the probe's positions, every
    layer; the exact system part and anything not held are left alone; nothing is stored."""
    from lmcache_backend.blend.segments.staleness_prior import ProbeAccumulator, measure_probe
    from lmcache_backend.integration.hf.engine import hf_full_prefill
    from lmcache_backend.ops.reference import rope_rerotate_k

    blender, cache = setup_blender(llama)
    for chunk in (C1, C2):
        warm_store(llama, cache, rag_prompt(SYS, chunk, Q1))
    held = len(cache.store._entries)
    pending = ProbeAccumulator()
    model, ops = blender.model, blender.ops
    measured = []
    for context in (C3, Q2 + C3):
        tokens = rag_prompt(SYS, context, C1, Q1)
        pre = hf_full_prefill(llama, tokens)

        def rows_of(segment, pre=pre):
            rows = slice(segment.start, segment.end)
            keys = torch.stack([k[rows] for k in pre.keys])
            return keys, torch.stack([v[rows] for v in pre.values])

        at = len(SYS) + len(SEP) + len(context) + len(SEP)
        c1 = slice(at, at + len(C1) + len(SEP))
        stored = _entry_of(cache, C1)
        # the reference: the stored keys turned to the probe's positions by the torch rotation
        keys = stored.keys.clone()
        n = keys.shape[1]
        old = torch.arange(stored.start_position, stored.start_position + n)
        for layer in range(keys.shape[0]):
            rope_rerotate_k(
                keys[layer], old, torch.arange(at, at + n), model.cos_sin_cache, model.is_neox
            )
        k_probe = torch.stack([k[c1] for k in pre.keys])
        v_probe = torch.stack([v[c1] for v in pre.values])
        dk = (k_probe - keys).pow(2).sum(dim=(-1, -2))
        dv = (v_probe - stored.values).pow(2).sum(dim=(-1, -2))
        measured.append((dk + dv).sqrt())
        written = measure_probe(cache, tokens, rows_of, 2, pending, model, ops)
    assert written == 1 and len(cache.store._entries) == held  # C1's entry, replaced
    entry = _entry_of(cache, C1)
    expected = (measured[0] + measured[1]) / 2
    assert entry.staleness.dtype == torch.float16
    assert entry.staleness.shape == (llama.config.num_hidden_layers, len(C1) + len(SEP))
    # fp32 model, fp16 prior: 1e-3 relative
    torch.testing.assert_close(entry.staleness.float(), expected, rtol=1e-3, atol=1e-3)
    assert bool((entry.staleness[1:] > 0).all())  # every layer after the first moved
    assert entry.context == stored.context  # the entry is the same computation, with its prior
    torch.testing.assert_close(entry.keys, stored.keys, rtol=0, atol=0)
    other = _entry_of(cache, C2)
    assert other.staleness is None  # never probed
