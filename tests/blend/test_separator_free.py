"""Separator-free reuse (``blend_special_str = ""``): token blocks found at any offset."""

from __future__ import annotations

import pytest
import torch

from lmcache_backend.blend import LMCBlender, SegmentCache
from lmcache_backend.blend.segmenting import BlockPattern, Segment, segment_pattern
from lmcache_backend.config import ConfigError, load_config
from lmcache_backend.integration.hf.engine import hf_full_prefill
from lmcache_backend.models.hf import HFModelAdapter
from lmcache_backend.ops import get_ops
from lmcache_backend.storage import MemoryTier

B = 8
TURN = (3, 4)  # stands for the chat template's "next user message" ids


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


def test_store_units_are_aligned_blocks_before_the_tail() -> None:
    pattern = BlockPattern(B, TURN)
    tokens = _chat(D1, D2, question=Q1)
    tail = len(tokens) - len(Q1) - len(TURN)
    assert pattern.query_start(tokens) == tail
    units = pattern.store_units(tokens)
    assert units == [Segment(i, i + B) for i in range(0, tail - B + 1, B)]
    # split covers every token once: the blocks, then the rest (incl. the tail)
    split = pattern.split(tokens)
    assert split[:-1] == units and split[-1] == Segment(units[-1].end, len(tokens))
    # no chat structure: the last block_size tokens are the tail
    assert BlockPattern(B).query_start(list(range(100))) == 100 - B


@pytest.mark.parametrize("shift", [0, 1, 3, 7, 8, 13])
def test_blocks_found_at_any_offset(shift: int) -> None:
    pattern = BlockPattern(B, TURN)
    first = _chat(D1, D2, D3, question=Q1)
    stored = [first[s.start : s.end] for s in pattern.store_units(first)]
    # the documents reordered, behind a system part of another length: every offset changes
    second = _chat(D3, D1, D2, question=Q2)
    second = _ids(shift, 99) + second if shift else second
    hits = pattern.match(second, _held_by(stored)(second))
    assert hits, "blocks must be found"
    for s in hits:  # each hit is a stored block, found wherever it now is
        assert second[s.start : s.end] in stored
        assert s.end <= pattern.query_start(second)
    assert all(a.end <= b.start for a, b in zip(hits, hits[1:]))
    covered = sum(len(s) for s in hits)
    # each document is found but for its edges (< B tokens at each end)
    for doc in (D1, D2, D3):
        start = next(i for i in range(len(second)) if second[i : i + len(doc)] == doc)
        inside = sum(max(0, min(s.end, start + len(doc)) - max(s.start, start)) for s in hits)
        assert inside >= len(doc) - 2 * (B - 1), (doc, inside)
    assert covered < pattern.query_start(second)  # unmatched edges remain to compute


def test_query_tail_never_matched() -> None:
    pattern = BlockPattern(B, TURN)
    # an earlier prompt held this question as a document: its blocks are stored
    earlier = _chat(Q1 * 3, D1, question=Q2)
    stored = [earlier[s.start : s.end] for s in pattern.store_units(earlier)]
    now = _chat(D1, question=Q1 * 3)
    hits = pattern.match(now, _held_by(stored)(now))
    assert hits and all(s.end <= pattern.query_start(now) for s in hits)
    assert pattern.query_start(now) == len(now) - 3 * len(Q1) - len(TURN)


def test_turn_start_from_chat_templates() -> None:
    from transformers import AutoTokenizer

    from lmcache_backend.data.embedded import embedded_model_path

    tok = AutoTokenizer.from_pretrained(embedded_model_path())
    pattern = segment_pattern(tok, "", 16)
    assert isinstance(pattern, BlockPattern) and pattern.block_size == 16
    assert tok.convert_ids_to_tokens(list(pattern.turn_start)) == [
        "<|im_end|>",
        "Ċ",
        "<|im_start|>",
        "user",
    ]
    messages = [{"role": "system", "content": "Be brief."}]
    messages += [{"role": "user", "content": f"Document {i}: text."} for i in range(3)]
    messages += [{"role": "user", "content": "Which document?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    tail = tok.decode(ids[pattern.query_start(ids) :])
    assert "Which document?" in tail and "Document 2" not in tail


def test_turn_start_sentencepiece(tmp_path) -> None:
    pytest.importorskip("sentencepiece")
    from local_tokenizers import sentencepiece_tokenizer

    tok = sentencepiece_tokenizer(tmp_path)
    pattern = segment_pattern(tok, "", 16)
    assert pattern.turn_start
    messages = [{"role": "user", "content": "Alice lives in Paris."}]
    messages += [{"role": "user", "content": "Who lives in Paris?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[pattern.query_start(ids) :]).count("Paris") == 1


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
    pattern = BlockPattern(B, TURN)
    blender = LMCBlender(store, None, config, adapter, pattern, get_ops("torch"))
    return blender, SegmentCache(store, adapter.fingerprint, pattern)


def test_blender_reuses_shifted_blocks_and_recomputes_edges(tiny) -> None:
    blender, cache = _blender(tiny, 1.0)
    first = _chat(D1, D2, D3, question=Q1)
    pre = hf_full_prefill(tiny, first)
    assert cache.store_segments(first, pre.keys, pre.values) == len(
        BlockPattern(B, TURN).store_units(first)
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
    assert not valid[cache.query_start(second) :].any(), "the question is always computed"
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
