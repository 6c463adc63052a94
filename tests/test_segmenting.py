"""Segmenting on the separator's token ids, and blend-ready prompts."""

from __future__ import annotations

import pytest

from lmcache_backend.segmenting import (
    Segment,
    build_blend_prompt,
    separator_token_ids,
    split_segments,
)


def _pieces(tokens, segments):
    return [tokens[s.start : s.end] for s in segments]


def test_spt_semantics_from_lmcache_docs() -> None:
    x, y, z, s = 1, 2, 3, 9
    tokens = [x, x, x, s, y, y, s, z, z, z, z]
    assert _pieces(tokens, split_segments(tokens, [s])) == [
        [x, x, x, s],
        [y, y, s],
        [z, z, z, z],
    ]


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ([], []),
        ([4, 5], [[4, 5]]),
        ([7, 8], [[7, 8]]),
        ([1, 7, 8, 2, 7, 8], [[1, 7, 8], [2, 7, 8]]),
        ([7, 7, 8, 3], [[7, 7, 8], [3]]),
        ([7, 8, 7, 8], [[7, 8], [7, 8]]),
        ([1, 7, 2, 8], [[1, 7, 2, 8]]),
    ],
    ids=[
        "empty",
        "no-separator",
        "only-separator",
        "trailing",
        "overlap-start",
        "back-to-back",
        "split-separator",
    ],
)
def test_multi_token_separator(tokens, expected) -> None:
    segments = split_segments(tokens, [7, 8])
    assert _pieces(tokens, segments) == expected
    assert sum(len(s) for s in segments) == len(tokens)


def test_empty_separator_rejected() -> None:
    with pytest.raises(ValueError):
        split_segments([1, 2], [])


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    from lmcache_backend.embedded import embedded_model_path

    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(
        path, add_bos_token=True
    )


def test_separator_ids_never_drop_a_token(tokenizers) -> None:
    plain, with_bos = tokenizers
    # The SmolLM2 tokenizer adds no BOS: encode(sep)[1:] would lose the first " #" token.
    assert plain.encode(" # # ")[1:] != separator_token_ids(plain, " # # ")
    assert separator_token_ids(plain, " # # ") == separator_token_ids(with_bos, " # # ")
    assert plain.decode(separator_token_ids(plain, " # # ")) == " # # "


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "plain"])
@pytest.mark.parametrize("which", [0, 1], ids=["no-bos", "bos"])
def test_build_blend_prompt(tokenizers, which: int, chat: bool) -> None:
    tok = tokenizers[which]
    chunks = ["Alice lives in Paris.", "Bob owns a cat named Tom.", "Carol plays the harp."]
    prompt = build_blend_prompt(
        tok, "Use the context.", chunks, "Who owns a cat?", use_chat_template=chat
    )
    sep = separator_token_ids(tok, " # # ")
    # the helper's segments are exactly what splitting on the separator finds
    assert split_segments(prompt.token_ids, sep) == prompt.segments
    assert len(prompt.segments) == len(chunks) + 2
    # each chunk segment is the chunk encoded alone, plus the separator: same ids in any prompt
    for seg, chunk in zip(prompt.segments[1:-1], chunks):
        assert (
            prompt.token_ids[seg.start : seg.end]
            == tok.encode(chunk, add_special_tokens=False) + sep
        )
    bos = tok.bos_token_id
    if which == 1:
        assert prompt.token_ids[0] == bos
    if not chat:  # (SmolLM2's chat turns start with its BOS token, so only the plain form)
        assert bos not in prompt.token_ids[1:]
    text = tok.decode(prompt.token_ids)
    assert "Who owns a cat?" in text and "Alice lives in Paris." in text


def test_reordered_chunks_keep_their_ids(tokenizers) -> None:
    tok = tokenizers[0]
    chunks = ["First chunk text.", "Second chunk text.", "Third chunk text."]
    a = build_blend_prompt(tok, "sys", chunks, "q?")
    b = build_blend_prompt(tok, "sys", chunks[::-1], "q?")
    pieces_a = _pieces(a.token_ids, a.segments)
    pieces_b = _pieces(b.token_ids, b.segments)
    assert pieces_a[0] == pieces_b[0] and pieces_a[-1] == pieces_b[-1]
    assert pieces_a[1:-1] == pieces_b[1:-1][::-1]


def test_segment_len() -> None:
    assert len(Segment(3, 10)) == 7
