"""A stored segment's provenance (what preceded it when it was computed) against its place in a
later prompt: exact segments, how far a segment's context then is from its context now, entries
without provenance, and the exact run the blend leaves alone."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import C1, C2, C3, Q1, Q2, SEP, SYS, rag_prompt, setup_blender, tiny_model, warm_store

from lmcache_backend.blend.segments.provenance import (
    HitContext,
    exact_rows,
    exact_run,
    prefix_digests,
)
from lmcache_backend.storage.segments import SegmentKV, context_digest


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _contexts(blender, tokens):
    task = blender.retriever.new_request(tokens, None)
    return {start: ctx for (start, _), ctx in zip(task.hits, task.contexts)}, task


def test_prefix_digests_are_the_digests_of_each_prefix():
    tokens = list(range(40))
    got = prefix_digests(tokens, [17, 0, 33, 17])
    assert got == {s: context_digest(tokens[:s]) for s in (0, 17, 33)}


def test_chunks_stored_by_a_request_in_the_same_order_are_exact(llama):
    blender, cache = setup_blender(llama)
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C1, C2, C3, Q2)  # the same chunks in the same order, a new question
    contexts, task = _contexts(blender, tokens)
    assert len(contexts) == 4 and all(c.exact and c.distance == 0.0 for c in contexts.values())
    kv = task.hits[2][1]  # C2: stored after the system part and C1
    assert kv.context == context_digest(tokens[: task.hits[2][0]]) and len(kv.preceding) == 2
    assert exact_run(task.contexts) == len(rag_prompt(SYS, C1, C2, C3, []))  # up to the question
    meta = blender.start_request(tokens)
    assert meta.exact_prefix == exact_run(task.contexts)


def test_chunks_in_another_order_are_as_far_as_the_units_they_did_not_share(llama):
    blender, cache = setup_blender(llama)
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    contexts, task = _contexts(blender, tokens)
    sys_n, c1_n, c3_n = len(SYS) + len(SEP), len(C1) + len(SEP), len(C3) + len(SEP)
    at_c3, at_c1 = sys_n, sys_n + c3_n
    at_c2 = at_c1 + c1_n
    assert contexts[0].exact and contexts[0].distance == 0.0
    # C3 was stored after SYS, C1, C2, now after SYS alone: one unit of three shared
    assert not contexts[at_c3].exact and contexts[at_c3].distance == pytest.approx(2 / 3)
    # C1 was stored after SYS, now after SYS and C3: one of two
    assert contexts[at_c1].distance == pytest.approx(1 / 2)
    # C2 was stored after SYS and C1, now after SYS, C3, C1: two of three
    assert contexts[at_c2].distance == pytest.approx(1 / 3)
    assert exact_run(task.contexts) == sys_n
    assert exact_rows(task.contexts, len(tokens))[:sys_n].all()
    assert not exact_rows(task.contexts, len(tokens))[sys_n:].any()


def test_a_chunk_encoded_alone_after_the_system_part_is_exact_only_right_after_it(llama):
    blender, cache = setup_blender(llama, selection="query_preview_last", ratios=(0.5,))
    for chunk in (C1, C2, C3):  # as lmcache-backend ingest stores a corpus
        warm_store(llama, cache, rag_prompt(SYS, chunk, Q1))
    tokens = rag_prompt(SYS, C2, C3, C1, Q2)
    contexts, task = _contexts(blender, tokens)
    sys_n, c2_n, c3_n = len(SYS) + len(SEP), len(C2) + len(SEP), len(C3) + len(SEP)
    assert contexts[0].exact and contexts[sys_n].exact and contexts[sys_n].distance == 0.0
    # computed after the system part alone, now the k-th chunk after it: 1 - 1/k away
    assert contexts[sys_n + c2_n].distance == pytest.approx(1 / 2)
    assert contexts[sys_n + c2_n + c3_n].distance == pytest.approx(2 / 3)
    # the blend leaves the system part and the first chunk alone: they are full prefill's
    result = blender.blend(tokens)
    assert result.blended
    recomputed = result.recomputed[result.valid_mask[result.recomputed]]
    assert recomputed.numel() > 0 and int(recomputed.min()) >= sys_n + c2_n


def test_entries_without_provenance_read_as_unknown(llama):
    """Entries written before provenance was recorded: never exact by provenance, their distance
    unknown; a segment stored at position 0 is still the exact prefix."""
    from lmcache_backend.integration.hf.engine import hf_full_prefill

    blender, cache = setup_blender(llama)
    stored = rag_prompt(SYS, C1, C2, C3, Q1)
    pre = hf_full_prefill(llama, stored)
    for seg in cache.cacheable_segments(stored):
        rows = slice(seg.start, seg.end)
        kv = SegmentKV(
            torch.stack([k[rows] for k in pre.keys]),
            torch.stack([v[rows] for v in pre.values]),
            seg.start,
        )
        assert cache.store.put(cache.key(stored, seg), kv)
    tokens = rag_prompt(SYS, C1, C2, C3, Q2)
    contexts, task = _contexts(blender, tokens)
    assert all(not c.exact and c.distance is None for c in contexts.values())
    assert blender.start_request(tokens).exact_prefix == len(SYS) + len(SEP)
    assert exact_run([HitContext(0, 4, False, None)]) == 0
