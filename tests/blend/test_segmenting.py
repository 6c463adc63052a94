"""Segmenting on the separator's token ids, and blend-ready prompts."""

from __future__ import annotations

import pytest

from lmcache_backend.blend.segmenting import (
    PROMPT_SHAPES,
    Segment,
    build_blend_prompt,
    separator_pattern,
    separator_token_ids,
    shaped_prompt,
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

    from lmcache_backend.data.embedded import embedded_model_path

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
    sep = separator_pattern(tok, " # # ")
    # the helper's segments are exactly what splitting on the separator finds
    assert sep.split(prompt.token_ids) == prompt.segments
    assert len(prompt.segments) == len(chunks) + 2
    # each chunk segment is the chunk as it tokenizes after the separator, plus the separator
    for seg, chunk in zip(prompt.segments[1:-1], chunks):
        assert prompt.token_ids[seg.start : seg.end] == tok.encode(
            " " + chunk, add_special_tokens=False
        ) + list(sep.ids)
    bos = tok.bos_token_id
    if which == 1:
        assert prompt.token_ids[0] == bos
    if not chat:  # (SmolLM2's chat turns start with its BOS token, so only the plain form)
        assert bos not in prompt.token_ids[1:]
    text = tok.decode(prompt.token_ids)
    assert "Who owns a cat?" in text and "Alice lives in Paris." in text


@pytest.mark.parametrize("which", [0, 1], ids=["no-bos", "bos"])
def test_prompt_shapes(tokenizers, which: int) -> None:
    """``text`` is the separated prompt as plain completions text ending in ``Answer:`` (no
    chat turns), ``separator`` the chat one; an unknown shape names itself."""
    tok = tokenizers[which]
    chunks = ["Alice lives in Paris.", "Bob owns a cat named Tom."]
    text = shaped_prompt(tok, "text", "Use the context.", chunks, "Who owns a cat?")
    assert text == tok.encode(
        "Use the context. # # Alice lives in Paris. # # Bob owns a cat "
        "named Tom. # # Question: Who owns a cat?\nAnswer:"
    )
    assert len(separator_pattern(tok, " # # ").split(text)) == len(chunks) + 2
    # a question with a template of its own (ending in "Answer:") is posed as it is
    own = shaped_prompt(tok, "text", "Use the context.", chunks, "Reply briefly.\nQ: cat?\nAnswer:")
    assert own == tok.encode(
        "Use the context. # # Alice lives in Paris. # # Bob owns a cat "
        "named Tom. # # Reply briefly.\nQ: cat?\nAnswer:"
    )
    chat = shaped_prompt(tok, "separator", "Use the context.", chunks, "Who owns a cat?")
    assert chat == build_blend_prompt(tok, "Use the context.", chunks, "Who owns a cat?").token_ids
    assert set(PROMPT_SHAPES) == {"separator", "stock", "text"}
    with pytest.raises(ValueError, match="prompt shape 'chat' is not one of separator, stock"):
        shaped_prompt(tok, "chat", "s", chunks, "q")


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


# -- the separator inside text: BPE (SmolLM2) and SentencePiece (Llama-2 style) ----------------


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    from local_tokenizers import sentencepiece_tokenizer

    return sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module", params=["bpe", "sentencepiece"])
def any_tokenizer(request, tokenizers, sp_tokenizer):
    return tokenizers[0] if request.param == "bpe" else sp_tokenizer


def _names(tok, ids):
    return tok.convert_ids_to_tokens(list(ids))


def test_separator_pattern_is_what_text_produces(tokenizers, sp_tokenizer) -> None:
    bpe = tokenizers[0]
    # alone, the separator ends with a lone space token that never occurs inside text
    assert _names(bpe, separator_token_ids(bpe, " # # ")) == ["Ġ#", "Ġ#", "Ġ"]
    assert _names(bpe, separator_pattern(bpe, " # # ").ids) == ["Ġ#", "Ġ#"]
    assert _names(sp_tokenizer, separator_pattern(sp_tokenizer, " # # ").ids) == ["▁#", "▁#"]
    # the same pattern whether the tokenizer adds a BOS or not
    assert separator_pattern(tokenizers[1], " # # ") == separator_pattern(bpe, " # # ")


@pytest.mark.parametrize("sep", [" # # ", "\n\n###\n\n", " [SEP] "])
def test_separator_found_in_text(any_tokenizer, sep) -> None:
    tok = any_tokenizer
    pattern = separator_pattern(tok, sep)
    text = f"System text.{sep}El gato duerme.{sep}The dog runs.{sep}1 more?"
    tokens = tok.encode(text)
    segments = pattern.split(tokens)
    assert len(segments) == 4, _names(tok, tokens)
    assert pattern.query_start(tokens) == segments[-1].start
    assert [s.end for s in pattern.cacheable_segments(tokens)] == [s.end for s in segments[:-1]]


@pytest.mark.parametrize("sep", ["", " "])
def test_separator_without_visible_characters_rejected(tokenizers, sep) -> None:
    with pytest.raises(ValueError):
        separator_pattern(tokenizers[0], sep)


def _chat_text_ids(tok, system, chunks, question):
    """What a chat client's text becomes in vLLM: the template rendered, encoded as a whole
    without special tokens."""
    content = " # # " + " # # ".join(chunks) + " # # " + question
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_text_prompt_and_built_prompt_share_segment_keys(any_tokenizer, chat) -> None:
    from lmcache_backend.models.fingerprint import ModelFingerprint
    from lmcache_backend.storage.segments import segment_key

    fp = ModelFingerprint("TestLM", 2, 4, 2, 8, "theta=10000.0,neox=True", "float32", "w0")
    tok = any_tokenizer
    pattern = separator_pattern(tok, " # # ")
    chunks = ["Alice lives in Paris.", "El gato duerme.", "1 cat is named Tom.", "(Bob) plays."]

    def keys(tokens):
        return {
            segment_key(fp, tokens[s.start : s.end]) for s in pattern.cacheable_segments(tokens)
        }

    built = build_blend_prompt(tok, "Use the context.", chunks, "Who?", use_chat_template=chat)
    if chat:
        text_ids = _chat_text_ids(tok, "Use the context.", chunks[::-1], "Where?")
    else:
        text_ids = tok.encode("Use the context. # # " + " # # ".join(chunks[::-1]) + " # # Where?")
    # every segment of the built prompt (system part and chunks) is found in the reordered text
    assert keys(built.token_ids) == keys(text_ids)
    assert len(keys(text_ids)) == len(chunks) + 1


def test_reordered_chunks_keep_their_ids_sentencepiece(sp_tokenizer) -> None:
    chunks = ["First chunk text.", "Second chunk text.", "Third chunk text."]
    a = build_blend_prompt(sp_tokenizer, "sys", chunks, "q?")
    b = build_blend_prompt(sp_tokenizer, "sys", chunks[::-1], "q?")
    pieces_a = _pieces(a.token_ids, a.segments)
    pieces_b = _pieces(b.token_ids, b.segments)
    assert pieces_a[1:-1] == pieces_b[1:-1][::-1]


def test_chat_messages_put_one_separator_before_each_part() -> None:
    from lmcache_backend.blend.segmenting import chat_messages

    two = chat_messages("S", ["a", "b"], "Q?", " # # ")
    assert two[1] == {"role": "user", "content": " # # a # # b # # Q?"}
    none = chat_messages("S", [], "Q?", " # # ")
    assert none == [{"role": "system", "content": "S"}, {"role": "user", "content": " # # Q?"}]
