"""``lmcache-backend demo``: RAG chats through vLLM's OpenAI server with ``CacheBlendConnector``.

It starts ``lmcache-backend serve`` (vLLM's OpenAI-compatible server with the connector) on the
embedded model, on a free loopback port, and talks to it with the ``openai`` client, as an
application would: chat requests, the documents in the user message, each preceded by the
separator ``" # # "``. For each RAG chat:

1. warm-up: the documents in their original order, with a different question, fill the store
   (vLLM prefills; the connector stores each document's K/V);
2. the documents reordered, with the chat's own question (never seen before), twice:
   full prefill (the request opts out: ``kv_transfer_params={"blend": false}``) and CacheBlend.

TTFT is measured by the client: time from sending the streaming request to its first content
chunk. Both requests run on the same server, one at a time, with vLLM's prefix cache off, so the
full prefill really computes every token. The server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmcache_backend.errors import USAGE_EXIT, UsageError
from lmcache_backend.integration.vllm.serving.process import ServerExited, ServerProcess
from lmcache_backend.settings.writer import Variables

#: The separator between documents (``blend_special_str``'s default).
SEPARATOR = " # # "

#: The warm-up question: the documents are stored under a question the chats never ask.
WARM_QUESTION = "Which names appear in the documents?"


@dataclass
class Reply:
    """One streamed answer: its text and the client-side time to the first content chunk."""

    text: str
    ttft_s: float
    total_s: float


class RagClient:
    """Sends RAG requests as text, the way an application does.

    ``fmt="chat"``: chat requests, a system message and one user message holding the documents
    and the question, each preceded by ``blend_special_str``
    (:func:`~lmcache_backend.blend.segmenting.chat_messages`). ``fmt="completions"``: completions
    requests whose prompt is the text ``system + SEP + doc_1 + ... + SEP + question``.
    """

    FORMATS = ("chat", "completions")

    def __init__(self, client: Any, model: str, tokenizer: Any, fmt: str = "chat") -> None:
        if fmt not in self.FORMATS:
            raise ValueError(f"unknown request format {fmt!r}: one of {self.FORMATS}")
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.fmt = fmt

    def with_client(self, client: Any) -> RagClient:
        return RagClient(client, self.model, self.tokenizer, self.fmt)

    def prompt(self, system: str, docs: list[str], question: str) -> list[int]:
        """The prompt's token ids as the server tokenizes them."""
        from lmcache_backend.blend.segmenting import build_blend_prompt

        chat = self.fmt == "chat"
        return build_blend_prompt(
            self.tokenizer, system, docs, question, use_chat_template=chat
        ).token_ids

    def ask(
        self,
        system: str,
        docs: list[str],
        question: str,
        max_tokens: int = 24,
        params: dict | None = None,
        stream: bool = True,
        cache_salt: str | None = None,
    ) -> Reply:
        """Ask ``question`` over ``docs``; ``params``: the request's ``kv_transfer_params``;
        ``cache_salt``: vLLM's per-tenant cache isolation (requests of different salts share
        no cached K/V)."""
        from lmcache_backend.blend.segmenting import chat_messages

        body: dict[str, Any] = {}
        if params is not None:
            body["kv_transfer_params"] = params
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        kwargs: dict[str, Any] = dict(
            model=self.model, max_tokens=max_tokens, temperature=0, extra_body=body or None
        )
        if self.fmt == "chat":
            create = self.client.chat.completions.create
            kwargs["messages"] = chat_messages(system, docs, question)
        else:
            create = self.client.completions.create
            kwargs["prompt"] = SEPARATOR.join([system, *docs, question])
        start = time.perf_counter()
        if not stream:
            out = create(**kwargs)
            elapsed = time.perf_counter() - start
            return Reply(self._text(out.choices[0], False), elapsed, elapsed)
        first = None
        parts: list[str] = []
        for chunk in create(stream=True, **kwargs):
            text = self._text(chunk.choices[0], True) if chunk.choices else ""
            if text:
                if first is None:
                    first = time.perf_counter() - start
                parts.append(text)
        total = time.perf_counter() - start
        return Reply("".join(parts), total if first is None else first, total)

    def _text(self, choice: Any, delta: bool) -> str:
        if self.fmt == "completions":
            return choice.text or ""
        return (choice.delta.content if delta else choice.message.content) or ""


@dataclass
class ChatRow:
    question: str
    gold: str
    prompt_tokens: int
    full: Reply
    blend: Reply
    recomputed: int = 0
    reusable: int = 0
    speedup: float = field(init=False)
    matches: bool = field(init=False)
    correct: bool = field(init=False)

    def __post_init__(self) -> None:
        self.speedup = self.full.ttft_s / max(self.blend.ttft_s, 1e-9)
        self.matches = self.full.text == self.blend.text
        self.correct = self.gold.lower() in self.blend.text.lower()


def longer(chunks: list[str], repeat: int) -> list[str]:
    """Each document repeated ``repeat`` times (longer prompts show the TTFT difference)."""
    return [" ".join([c] * repeat) for c in chunks]


def run_chats(
    rag: RagClient,
    stats: Any,
    examples: int = 3,
    chunk_repeat: int = 2,
    max_tokens: int = 24,
    out=sys.stdout,
) -> list[ChatRow]:
    """Warm up, then ask each example's question over reordered documents, opted out and blended.

    ``stats()`` returns the connector's blend records so far (to report recomputed tokens).
    """
    from lmcache_backend.data.examples import builtin_examples, reordered

    rows: list[ChatRow] = []
    for i, ex in enumerate(builtin_examples(examples, chunks_per_example=4)):
        docs = longer(ex.chunks, chunk_repeat)
        rag.ask(ex.system, docs, WARM_QUESTION, max_tokens=1, stream=False)  # fills the store
        again = reordered(docs, seed=i + 1)
        full = rag.ask(ex.system, again, ex.question, max_tokens, params={"blend": False})
        before = len(stats())
        blend = rag.ask(ex.system, again, ex.question, max_tokens)
        records = stats()[before:]
        row = ChatRow(
            question=ex.question,
            gold=ex.answers[0],
            prompt_tokens=len(rag.prompt(ex.system, again, ex.question)),
            full=full,
            blend=blend,
            recomputed=sum(r["recomputed_reusable"] for r in records),
            reusable=sum(r["num_reusable"] for r in records),
        )
        rows.append(row)
        _print_row(i + 1, row, out)
    return rows


def _print_row(index: int, row: ChatRow, out) -> None:
    blended = (
        f"{row.recomputed}/{row.reusable} reusable tokens recomputed"
        if row.reusable
        else "NOT blended (no cached documents found)"
    )
    print(
        f"\nchat {index}: {row.question}  ({row.prompt_tokens} prompt tokens; gold: {row.gold})",
        file=out,
    )
    print(
        f"  full prefill  TTFT {1000 * row.full.ttft_s:8.0f} ms  {row.full.text.strip()!r}",
        file=out,
    )
    print(
        f"  CacheBlend    TTFT {1000 * row.blend.ttft_s:8.0f} ms  {row.blend.text.strip()!r}",
        file=out,
    )
    print(
        f"  speedup {row.speedup:.2f}x, answers {'match' if row.matches else 'differ'}; {blended}",
        file=out,
    )


def _start(server: ServerProcess) -> None:
    """Start the server; a mistake ``serve`` refused (exit status 2) is raised as the one line
    it printed."""
    try:
        server.start()
    except ServerExited as exc:
        lines = exc.log_tail.strip().splitlines()
        if exc.returncode != USAGE_EXIT or not lines:
            raise
        raise UsageError(lines[-1].removeprefix("lmcache-backend serve: ")) from None


def run_demo(
    ratio: float | None = None,
    examples: int = 3,
    chunk_repeat: int = 2,
    max_tokens: int = 24,
    out=sys.stdout,
) -> dict:
    """Start the server, run the chats, stop the server; return the numbers. ``ratio`` None
    keeps the configured settings (``LMCACHE_*``, the package defaults)."""
    from transformers import AutoTokenizer

    from lmcache_backend.config import load_config

    ratios: Variables = {} if ratio is None else {"blend_recompute_ratios": [ratio]}
    config = load_config().replace(**ratios)  # what the server loads: the ratio given on top
    setting = f"{config.blend_selection}, ratio {config.blend_recompute_ratios[-1]:g}"

    from lmcache_backend.data.embedded import EMBEDDED_MODEL_NAME, embedded_model_path

    model = str(embedded_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    with tempfile.TemporaryDirectory(prefix="lmcache-backend-demo-") as tmp:
        server = ServerProcess(
            # prefix caching off: the opted-out request is a full prefill of every token
            ["--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "4096"],
            variables=ratios,
            stats_file=Path(tmp) / "blend.jsonl",
            log_path=Path(tmp) / "server.log",
            model=model,
        )
        print(
            f"starting vLLM's OpenAI server with CacheBlendConnector on {server.base_url} "
            f"({EMBEDDED_MODEL_NAME}, {setting}) ...",
            file=out,
            flush=True,
        )
        started = time.perf_counter()
        try:
            _start(server)
            print(f"server ready in {time.perf_counter() - started:.0f} s", file=out, flush=True)
            rag = RagClient(server.client(), model, tokenizer)
            rows = run_chats(rag, server.stats, examples, chunk_repeat, max_tokens, out)
        except UsageError:
            raise
        except Exception:
            print(f"server log (last lines):\n{server.log_tail()}", file=out)
            raise
        finally:
            server.stop()
    speedup = statistics.median(r.speedup for r in rows)
    matches = sum(r.matches for r in rows)
    print(
        f"\n{matches} of {len(rows)} CacheBlend answers match full prefill "
        f"({setting}; a 135M model is sensitive to approximate K/V)",
        file=out,
    )
    print(f"CacheBlend speedup over full prefill (TTFT, median): {speedup:.2f}x", file=out)
    return {
        "model": EMBEDDED_MODEL_NAME,
        "ratio": config.blend_recompute_ratios[-1],
        "selection": config.blend_selection,
        "chats": [asdict(r) for r in rows],
        "cacheblend_speedup": speedup,
    }


def main(args: argparse.Namespace) -> int:
    result = run_demo(args.ratio, args.chats, args.chunk_repeat, args.max_new_tokens)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0
