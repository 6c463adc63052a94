"""Separator-free reuse (``blend_segmentation`` auto or blocks): blocks found at any offset."""

from __future__ import annotations

import pytest
import torch

from lmcache_backend.blend import LMCBlender, SegmentCache
from lmcache_backend.blend.segmenting import Segment, SeparatorPattern, build_blend_prompt
from lmcache_backend.blend.segments.patterns import AutoPattern, BlockPattern, segment_pattern
from lmcache_backend.config import ConfigError, load_config
from lmcache_backend.integration.hf.engine import hf_full_prefill
from lmcache_backend.models.hf import HFModelAdapter
from lmcache_backend.ops import get_ops
from lmcache_backend.storage import MemoryTier

B = 8
TURN = (3, 4)  # stands for the ids a chat template writes between two messages


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 256, (n,), generator=g).tolist()


SYS, D1, D2, D3, Q1, Q2 = (_ids(n, s) for s, n in enumerate((13, 37, 29, 45, 9, 11)))


def _chat(*docs: list[int], question: list[int]) -> list[int]:
    out = list(SYS)
    for doc in docs:
        out += list(TURN) + doc
    return out + list(TURN) + question


def _held_by(stored: list[list[int]]):
    """``held`` for a store holding exactly the blocks ``stored``."""
    keys = {tuple(b) for b in stored}

    def held(tokens):
        return lambda segs: [tuple(tokens[s.start : s.end]) in keys for s in segs]

    return held


def test_store_units_are_aligned_blocks_before_the_last_token() -> None:
    pattern = BlockPattern(B)
    tokens = _chat(D1, D2, question=Q1)
    assert pattern.query_start(tokens) == len(tokens) - 1
    units = pattern.store_units(tokens)
    assert units == [Segment(i, i + B) for i in range(0, len(tokens) - B, B)]
    assert units[-1].end <= len(tokens) - 1
    # split covers every token once: the blocks, then the rest
    split = pattern.split(tokens)
    assert split[:-1] == units and split[-1] == Segment(units[-1].end, len(tokens))


@pytest.mark.parametrize("shift", [0, 1, 3, 7, 8, 13])
def test_blocks_found_at_any_offset(shift: int) -> None:
    pattern = BlockPattern(B)
    first = _chat(D1, D2, D3, question=Q1)
    stored = [first[s.start : s.end] for s in pattern.store_units(first)]
    # the documents reordered, behind a system part of another length: every offset changes
    second = _chat(D3, D1, D2, question=Q2)
    second = _ids(shift, 99) + second if shift else second
    hits = pattern.match(second, _held_by(stored)(second))
    assert hits, "blocks must be found"
    for s in hits:  # each hit is a stored block, found wherever it now is
        assert second[s.start : s.end] in stored
        assert s.end <= len(second) - 1
    assert all(a.end <= b.start for a, b in zip(hits, hits[1:]))
    # each document is found but for its edges (< B tokens at each end)
    for doc in (D1, D2, D3):
        start = next(i for i in range(len(second)) if second[i : i + len(doc)] == doc)
        inside = sum(max(0, min(s.end, start + len(doc)) - max(s.start, start)) for s in hits)
        assert inside >= len(doc) - 2 * (B - 1), (doc, inside)
    # the blend ends after the last block found: the new question follows, computed fresh
    end = pattern.claim_end(second, hits)
    assert end == hits[-1].end <= len(second) - len(Q2)
    assert pattern.claim_end(second, []) == 0


def test_last_token_never_matched() -> None:
    pattern = BlockPattern(B)
    tokens = list(range(10, 10 + 4 * B + 1))  # the last block ends on the last token
    every = _held_by([tokens[i : i + B] for i in range(len(tokens))])(tokens)
    hits = pattern.match(tokens, every)
    assert hits and hits[-1].end <= len(tokens) - 1
    assert pattern.claim_end(tokens, hits) <= len(tokens) - 1


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from lmcache_backend.data.embedded import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())


DOCS = [
    "Marlow Keaton founded the Velsey Observatory in 1874 on the hill above the harbour.",
    "The Orrin river floods every spring, and the mill at Tessaly was rebuilt three times.",
    "Quenby Aldous wrote eleven operas; the last one was never performed in her lifetime.",
    "The coastal railway reached Port Ilse in 1903, two decades after it was first planned.",
]


@pytest.mark.parametrize("shape", ["system", "same message", "own messages"])
def test_documents_found_wherever_the_prompt_puts_them(shape: str) -> None:
    """Documents in the system message, next to the question in one user message (LlamaIndex's
    chat template), or one message each: found after reordering; the new question is not."""
    tok = _smollm2_tokenizer()
    pattern = segment_pattern(tok, " # # ", 16)
    assert isinstance(pattern, AutoPattern)

    def prompt(docs, question):
        context = "\n\n".join(docs)
        if shape == "system":
            messages = [{"role": "system", "content": "Answer from:\n\n" + context}]
            messages += [{"role": "user", "content": question}]
        elif shape == "same message":
            content = f"Context information is below.\n{context}\nQuery: {question}\nAnswer: "
            messages = [{"role": "user", "content": content}]
        else:
            messages = [{"role": "user", "content": d} for d in docs]
            messages += [{"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    first = prompt(DOCS, "Who founded the observatory?")
    assert pattern.for_prompt(first) is pattern.blocks  # no separator: blocks
    stored = [first[s.start : s.end] for s in pattern.store_units(first)]
    question = "Which river floods in spring, and what was rebuilt?"
    second = prompt([DOCS[i] for i in (2, 0, 3, 1)], question)
    hits = pattern.match(second, _held_by(stored)(second))
    end = pattern.claim_end(second, hits)
    reused = sum(len(h) for h in hits)
    doc_tokens = sum(len(tok.encode(d, add_special_tokens=False)) for d in DOCS)
    assert reused >= 0.5 * doc_tokens, (reused, doc_tokens)
    assert question.split()[0] in tok.decode(second[end:]), "the new question is computed"


def test_auto_cuts_prompts_with_the_separator_around_it() -> None:
    tok = _smollm2_tokenizer()
    auto = segment_pattern(tok, " # # ", 16)
    marked = build_blend_prompt(tok, "Be brief.", DOCS[:3], "Who wrote operas?").token_ids
    assert auto.for_prompt(marked) is auto.separator
    assert auto.store_units(marked) == auto.separator.store_units(marked)
    assert auto.claim_end(marked, auto.store_units(marked)) == auto.separator.query_start(marked)
    separator_only = segment_pattern(tok, " # # ", 16, "separator")
    assert isinstance(separator_only, SeparatorPattern)
    plain = tok.encode("\n\n".join(DOCS), add_special_tokens=False)
    assert separator_only.store_units(plain) == []  # LMCache's behaviour: nothing to reuse
    assert isinstance(segment_pattern(tok, " # # ", 16, "blocks"), BlockPattern)
    assert isinstance(segment_pattern(tok, "", 16, "separator"), BlockPattern)
    with pytest.raises(ValueError, match="segmentation 'chunks'"):
        segment_pattern(tok, " # # ", 16, "chunks")


def test_bad_segmentation_names_the_key() -> None:
    with pytest.raises(ConfigError, match="LMCACHE_BLEND_SEGMENTATION.*'chunk'"):
        load_config(env={"LMCACHE_BLEND_SEGMENTATION": "chunk"})
    assert load_config(env={}).blend_segmentation == "auto"


@pytest.mark.parametrize("value", [0, -4])
def test_bad_block_size(value) -> None:
    with pytest.raises(ConfigError, match="blend_block_size"):
        load_config(env={}, blend_block_size=value)
    with pytest.raises(ConfigError, match="LMCACHE_BLEND_BLOCK_SIZE"):
        load_config(env={"LMCACHE_BLEND_BLOCK_SIZE": str(value)})


def test_empty_separator_is_accepted() -> None:
    config = load_config(env={"LMCACHE_BLEND_SPECIAL_STR": ""})
    assert config.blend_special_str == "" and config.blend_block_size == 16


# -- through the blender, on a tiny random model ---------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from tiny_hf import tiny_model

    return tiny_model("llama")


def _blender(model, ratio: float):
    adapter = HFModelAdapter(model)
    store = MemoryTier("cpu", 1 << 30, "cpu")
    config = load_config(
        env={},
        enable_blending=True,
        blend_special_str="",
        blend_block_size=B,
        blend_min_tokens=0,
        blend_recompute_ratios=[ratio],
    )
    pattern = BlockPattern(B)
    blender = LMCBlender(store, None, config, adapter, pattern, get_ops("torch"))
    return blender, SegmentCache(store, adapter.fingerprint, pattern)


def test_blender_reuses_shifted_blocks_and_recomputes_edges(tiny) -> None:
    blender, cache = _blender(tiny, 1.0)
    first = _chat(D1, D2, D3, question=Q1)
    pre = hf_full_prefill(tiny, first)
    assert cache.store_segments(first, pre.keys, pre.values) == len(
        BlockPattern(B).store_units(first)
    )
    second = _ids(5, 7) + _chat(D3, D1, D2, question=Q2)
    hits = cache.match(second)
    result = blender.blend(second)
    valid = result.valid_mask
    expected = torch.zeros(len(second), dtype=torch.bool)
    for s in hits:
        expected[s.start : s.end] = True
    assert torch.equal(valid, expected)
    assert 0 < result.num_reusable < len(second)
    assert not valid[len(second) - len(Q2) :].any(), "the new question is always computed"
    # ratio 1: every token recomputed over the re-rotated blocks gives the full prefill
    full = hf_full_prefill(tiny, second)
    torch.testing.assert_close(result.logits, full.logits, rtol=0, atol=1e-3)
    # at ratio 0 the reused rows are the stored keys re-rotated: compare one block's values
    blender0, _ = _blender(tiny, 0.0)
    blender0.retriever = blender.retriever
    naive = blender0.blend(second)
    s = hits[0]
    src = next(i for i in range(len(first) - B + 1) if first[i : i + B] == second[s.start : s.end])
    torch.testing.assert_close(naive.values[2][s.start : s.end], pre.values[2][src : src + B])


def test_preview_computes_uncached_tokens_once(tiny) -> None:
    """The preview runs the tokens after the last reused block alone; the uncached tokens before
    them (chunk edges) are computed once, in the blend, not in the preview too."""
    blender, cache = _blender(tiny, 0.2)
    first = _chat(D1, D2, D3, question=Q1)
    pre = hf_full_prefill(tiny, first)
    cache.store_segments(first, pre.keys, pre.values)
    second = _ids(5, 7) + _chat(D3, D1, D2, question=Q2)
    result = blender.blend(second)
    valid = result.valid_mask
    last_reused = int(torch.nonzero(valid).max())
    assert int((~valid[:last_reused]).sum()) > 0, "the prompt must have edges to compute"
    tail = len(second) - last_reused - 1
    layers = tiny.config.num_hidden_layers
    # every recomputed token (edges, selected, tail) once in the blend, the tail in the preview
    assert result.token_layers == layers * (result.recomputed.numel() + tail)
    full = hf_full_prefill(tiny, second)
    assert torch.isfinite(result.logits).all()
    # close to the full prefill's next token distribution (tiny random model, ratio 0.2)
    kl = torch.nn.functional.kl_div(
        result.logits.float().log_softmax(-1),
        full.logits.float().log_softmax(-1),
        log_target=True,
        reduction="sum",
    )
    assert float(kl) < 0.5
