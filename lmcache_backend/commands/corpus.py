"""What ``lmcache-backend ingest`` reads: the corpus (chunks) and the prompt a chunk appears in.

A corpus is a JSONL file or a folder of text files:

* JSONL, one chunk a line: a JSON string, or an object with ``text`` (also ``page_content``,
  LangChain's ``Document`` field, or ``content``) and an optional ``id``; or an object with
  ``chunks``, a list of strings (a RAG example as the benchmark datasets hold them: every chunk
  is ingested).
* a folder: every ``*.txt`` / ``*.md`` file below it is one chunk (its text without surrounding
  whitespace), its path relative to the folder the id.

The same text twice is one chunk. A :class:`ChunkPrompt` is the prompt of the application with
one chunk in it: the chunk's K/V are computed in that prompt, after the system prompt and chat
template the application sends, so that a later request holding the chunk finds exactly them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_backend.bench.datasets.dataset import WARM_QUESTION
from lmcache_backend.blend.segmenting import PROMPT_SHAPES, STOCK_RAG_SYSTEM
from lmcache_backend.data.jsonl import read_jsonl
from lmcache_backend.logtext import shorten

#: where the chunk goes in a template
CHUNK = "{chunk}"
#: where the question goes (optional): ingestion puts a neutral question there (never stored)
QUESTION = "{question}"
#: the question of ingestion prompts: its tail is computed, never stored (as the benchmark warms)
INGEST_QUESTION = WARM_QUESTION
TEXT_FIELDS = ("text", "page_content", "content")
TEXT_SUFFIXES = (".txt", ".md")


class CorpusError(ValueError):
    """The corpus or template cannot be read; the message names the file, line and field."""


@dataclass(frozen=True)
class Chunk:
    """One document chunk: ``id`` names it in messages, ``text`` is what prompts hold."""

    id: str
    text: str


def read_corpus(path: str | Path) -> list[Chunk]:
    """The chunks of a JSONL file or a folder of text files, duplicates dropped (first kept).

    Raises:
        CorpusError: the path is missing or empty, a line is not JSON, or a line has no text.
    """
    path = Path(path)
    if path.is_dir():
        chunks = list(_folder(path))
    elif path.is_file():
        chunks = list(_jsonl(path))
    else:
        raise CorpusError(f"corpus {shorten(str(path))!r}: no such file or folder")
    seen: set[str] = set()
    unique = [c for c in chunks if not (c.text in seen or seen.add(c.text))]
    if not unique:
        raise CorpusError(f"corpus {shorten(str(path))!r} holds no chunk")
    return unique


def _folder(folder: Path) -> Iterator[Chunk]:
    for file in sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
        try:
            text = file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            where = shorten(str(file))
            raise CorpusError(f"{where}: cannot read it as UTF-8 text ({exc})") from None
        if text:
            yield Chunk(str(file.relative_to(folder)), text)


def _jsonl(file: Path) -> Iterator[Chunk]:
    for where, number, row in read_jsonl(file, CorpusError):
        yield from _row_chunks(row, where, number)


def _row_chunks(row: Any, where: str, number: int) -> Iterator[Chunk]:
    if isinstance(row, str):
        yield Chunk(f"line {number}", _text(row, where, "the line"))
        return
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a string or an object, got {type(row).__name__}")
    name = str(row.get("id", f"line {number}"))
    if "chunks" in row:
        chunks = row["chunks"]
        if not isinstance(chunks, list) or not chunks:
            raise CorpusError(f"{where}: field 'chunks' must be a non-empty list of strings")
        for i, text in enumerate(chunks):
            yield Chunk(f"{name}#{i}", _text(text, where, f"chunks[{i}]"))
        return
    for field in TEXT_FIELDS:
        if field in row:
            yield Chunk(name, _text(row[field], where, repr(field)))
            return
    raise CorpusError(f"{where}: no field 'text', 'page_content', 'content' or 'chunks'")


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CorpusError(f"{where}: {what} must be a non-empty string")
    return value


@dataclass(frozen=True)
class ChunkPrompt:
    """The application's prompt with a placeholder for one chunk.

    Attributes:
        messages: a chat (rendered by the model's chat template, as vLLM's chat endpoint
            does), or None.
        text: a completions prompt (encoded with the tokenizer's special tokens, as vLLM's
            completions endpoint does), or None.
        Exactly one of them is set; it holds :data:`CHUNK` once and :data:`QUESTION` at most
        once.
    """

    messages: tuple[tuple[str, str], ...] | None = None
    text: str | None = None

    def token_ids(self, tokenizer: Any, chunk: str) -> list[int]:
        """The prompt with ``chunk`` in it, tokenized as the server tokenizes it."""
        if self.text is not None:
            return [int(t) for t in tokenizer.encode(_fill(self.text, chunk))]
        messages = [{"role": r, "content": _fill(content, chunk)} for r, content in self.messages]
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return [int(t) for t in tokenizer.encode(rendered, add_special_tokens=False)]


def _fill(template: str, chunk: str) -> str:
    # placeholders replaced by position, never by str.format: chunks hold braces
    template = template.replace(QUESTION, INGEST_QUESTION)
    before, found, after = template.partition(CHUNK)
    return before + chunk + after if found else template


def shaped_template(shape: str, system: str, separator: str) -> ChunkPrompt:
    """The prompt of one of the package's prompt shapes (``bench --prompt-shape``) around
    ``system`` and the separator ``blend_special_str``.

    Raises:
        CorpusError: an unknown shape.
    """
    if shape == "separator":  # blend.segmenting.chat_messages
        user = separator + CHUNK + separator + QUESTION
        return ChunkPrompt(messages=(("system", system), ("user", user)))
    if shape == "text":  # blend.segmenting.shaped_prompt("text")
        text = f"{system}{separator}{CHUNK}{separator}Question: {QUESTION}\nAnswer:"
        return ChunkPrompt(text=text)
    if shape == "stock":  # blend.segmenting.stock_rag_prompt, one document
        context = STOCK_RAG_SYSTEM.replace("{context}", system + "\n\n" + CHUNK)
        return ChunkPrompt(messages=(("system", context), ("user", QUESTION)))
    raise CorpusError(f"prompt shape {shape!r} is not one of {', '.join(PROMPT_SHAPES)}")


def template_file(path: str | Path) -> ChunkPrompt:
    """A template from a file: an OpenAI-style request body (``{"messages": [...]}`` or
    ``{"prompt": "..."}``, JSON) or plain text (a completions prompt), holding ``{chunk}`` once.

    Raises:
        CorpusError: unreadable, not of that form, or ``{chunk}`` missing or repeated.
    """
    where = shorten(str(path))
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"template {where}: cannot read it ({exc})") from None
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        body = None
    if isinstance(body, dict) and "messages" in body:
        messages = body["messages"]
        ok = isinstance(messages, list) and all(
            isinstance(m, dict) and all(isinstance(m.get(f), str) for f in ("role", "content"))
            for m in messages
        )
        if not ok or not messages:
            raise CorpusError(
                f"template {where}: 'messages' must be a list of {{role, content}} strings"
            )
        prompt = ChunkPrompt(messages=tuple((m["role"], m["content"]) for m in messages))
        texts = [content for _, content in prompt.messages]
    elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
        prompt, texts = ChunkPrompt(text=body["prompt"]), [body["prompt"]]
    elif body is None or isinstance(body, str):
        text = raw if body is None else body
        prompt, texts = ChunkPrompt(text=text), [text]
    else:
        raise CorpusError(f"template {where}: expected a request body with 'messages' or 'prompt'")
    joined = "\n".join(texts)
    if joined.count(CHUNK) != 1 or joined.count(QUESTION) > 1:
        raise CorpusError(
            f"template {where}: must hold {CHUNK} exactly once (where a document goes) and "
            f"{QUESTION} at most once; it holds {CHUNK} {joined.count(CHUNK)} times"
        )
    return prompt
