"""``lmcache-backend ingest CORPUS``: encode a knowledge base ahead of time into the shared tiers.

Every chunk of the corpus (:mod:`lmcache_backend.commands.corpus`) is put into the prompt the
application sends (``--system`` and ``--prompt-shape``, or ``--template``), and that prompt is
prefilled by vLLM with the CacheBlend connector, opted out of blending: the connector stores the
prompt's units (the chunk, the system part) exactly as it stores those of a served request, in
the tiers the configuration names (``LMCACHE_*``, as ``serve`` reads them). A later request
holding the chunk finds it under the same key, on any engine sharing the tiers.

Resumable and idempotent: a chunk whose units all sit in every tier that outlives this command
(Redis, the disk tier) is skipped, so a second run writes nothing and an interrupted one goes on
where it stopped. Progress is a bar; the summary gives chunks, tokens and bytes written.

``--staleness-probes K`` then computes every chunk after ``K`` probe contexts (a few other
chunks of the corpus each, the same contexts for every chunk, so vLLM's prefix cache computes
each once) as staleness probes (``lmcache.staleness_probes``): the connector measures how far
the stored chunk's K/V move there and gives its entry that prior, which the staleness-aware
selection reads (docs/quality.md). It costs ``K`` more prefills of each chunk's tokens and ``2 L``
bytes a token in each tier.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_backend.commands.corpus import (
    Chunk,
    ChunkPrompt,
    CorpusError,
    read_corpus,
    shaped_template,
    template_file,
)

logger = logging.getLogger(__name__)

#: prompts handed to vLLM at once (it batches them; the system part is computed once per batch)
DEFAULT_BATCH = 32
DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using only the documents in the "
    "context. Answer with a few words."
)

#: ``keys -> present`` in every tier that outlives the command
Persisted = Callable[[Sequence[str]], list[bool]]
#: chunks of the corpus in each probe context
PROBE_CONTEXT_CHUNKS = 2


@dataclass
class ChunkJob:
    """One chunk's prompt and the store keys and lengths of the units the connector stores."""

    chunk: Chunk
    token_ids: list[int]
    keys: list[str]
    lengths: list[int]


@dataclass
class IngestSummary:
    chunks: int = 0
    skipped: int = 0  #: already stored by an earlier run or request
    written: int = 0
    failed: list[str] = field(default_factory=list)  #: chunk ids not stored (see the log)
    tokens: int = 0  #: tokens of the units newly stored
    bytes_per_tier: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        stored = ", ".join(f"{_size(b)} to {t}" for t, b in self.bytes_per_tier.items())
        return (
            f"ingested {self.written} of {self.chunks} chunks ({self.skipped} already stored, "
            f"{len(self.failed)} failed): {self.tokens:,} tokens, {stored or 'nothing written'}, "
            f"in {self.seconds:.1f} s"
        )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def plan(
    chunks: Sequence[Chunk],
    prompt: ChunkPrompt,
    tokenizer: Any,
    pattern: Any,
    keys_of: Callable[[list[int], list[tuple[int, int]]], list[str]],
) -> list[ChunkJob]:
    """Each chunk's prompt and the units the connector stores from it (``pattern.store_units``:
    the system part and the chunk, or the prompt's blocks without a separator)."""
    jobs = []
    for chunk in chunks:
        ids = prompt.token_ids(tokenizer, chunk.text)
        units = pattern.store_units(ids)
        spans = [(u.start, u.end) for u in units]
        jobs.append(ChunkJob(chunk, ids, keys_of(ids, spans), [e - s for s, e in spans]))
    return jobs


def run(
    jobs: Sequence[ChunkJob],
    prefill: Callable[[list[list[int]]], None],
    persisted: Persisted,
    bytes_per_token: dict[str, int],
    batch: int = DEFAULT_BATCH,
    progress: Callable[[int], None] = lambda n: None,
) -> IngestSummary:
    """Prefill the jobs whose units are not all persisted yet, ``batch`` prompts at a time.

    Args:
        prefill: computes the prompts (each stores its units through the connector).
        persisted: which keys every lasting tier holds (asked before and after each batch).
        bytes_per_token: per lasting tier, the bytes one token's K/V take there.
    """
    started = time.perf_counter()
    summary = IngestSummary(chunks=len(jobs), bytes_per_tier=dict.fromkeys(bytes_per_token, 0))
    counted: set[str] = set()  # units shared by chunks (the system part) count once
    pending: list[ChunkJob] = []
    for job in jobs:
        if all(persisted(job.keys)):
            summary.skipped += 1
            counted.update(job.keys)
            progress(1)
        else:
            pending.append(job)
    for i in range(0, len(pending), batch):
        group = pending[i : i + batch]
        before = {k for job in group for k, p in zip(job.keys, persisted(job.keys)) if p}
        prefill([job.token_ids for job in group])
        for job in group:
            present = persisted(job.keys)
            if not all(present):
                summary.failed.append(job.chunk.id)
            else:
                summary.written += 1
            for key, length, ok in zip(job.keys, job.lengths, present, strict=True):
                if ok and key not in before and key not in counted:
                    counted.add(key)
                    summary.tokens += length
            progress(1)
    for tier, per_token in bytes_per_token.items():
        summary.bytes_per_tier[tier] = summary.tokens * per_token
    summary.seconds = time.perf_counter() - started
    return summary


def probe_contexts(chunks: Sequence[Chunk], count: int, seed: int = 0) -> list[list[Chunk]]:
    """``count + 1`` probe contexts of :data:`PROBE_CONTEXT_CHUNKS` chunks each, no chunk in two
    of them, sampled from the corpus with ``seed``: a chunk is probed after the first ``count``
    that do not hold it (a corpus too small for that many gives fewer)."""
    import random

    size = PROBE_CONTEXT_CHUNKS
    picked = random.Random(seed).sample(list(chunks), min(len(chunks), size * (count + 1)))
    return [picked[i : i + size] for i in range(0, len(picked) - size + 1, size)]


def probe_prompts(
    jobs: Sequence[ChunkJob],
    contexts: Sequence[Sequence[Chunk]],
    count: int,
    prompt: ChunkPrompt,
    tokenizer: Any,
    separator: str,
) -> list[list[int]]:
    """Each job's chunk after each of the first ``count`` ``contexts`` not holding it, joined
    by ``separator`` as a prompt of several chunks joins them."""
    out = []
    for job in jobs:
        usable = [c for c in contexts if all(x.id != job.chunk.id for x in c)][:count]
        for context in usable:
            text = separator.join([*(c.text for c in context), job.chunk.text])
            out.append(prompt.token_ids(tokenizer, text))
    return out


def run_probes(
    prompts: Sequence[list[int]],
    probe: Callable[[list[list[int]]], None],
    batch: int = DEFAULT_BATCH,
    progress: Callable[[int], None] = lambda n: None,
) -> float:
    """Send the probe ``prompts``, ``batch`` at a time; the seconds it took."""
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = list(prompts[i : i + batch])
        probe(group)
        progress(len(group))
    return time.perf_counter() - started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("corpus", help="JSONL of chunks, or a folder of .txt/.md files")
    parser.add_argument(
        "--model",
        default=None,
        help="the model exactly as the engines are started with (default: the embedded "
        "smollm2): its fingerprint is part of every key",
    )
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype, as the engines use")
    parser.add_argument(
        "--system",
        default=None,
        help=f"the application's system prompt (default: {DEFAULT_SYSTEM!r})",
    )
    parser.add_argument("--system-file", help="read the system prompt from this file")
    parser.add_argument(
        "--prompt-shape",
        choices=("separator", "stock", "text"),
        default="separator",
        help="how the application sends a chunk: separator (a chat, chunks after "
        "blend_special_str in the user message), stock (LangChain's stock RAG chat), text "
        "(completions text) (default: separator)",
    )
    parser.add_argument(
        "--template",
        help="instead of --system/--prompt-shape: a sample request body (JSON with 'messages' "
        "or 'prompt') or text prompt holding {chunk} where a document goes",
    )
    parser.add_argument(
        "--batch", type=int, default=DEFAULT_BATCH, help=f"prompts per step ({DEFAULT_BATCH})"
    )
    parser.add_argument(
        "--staleness-probes",
        type=int,
        default=0,
        metavar="K",
        help="then compute each chunk after K probe contexts (other chunks of the corpus) and "
        "store how far its K/V move there, the prior the staleness-aware selection reads "
        "(default: 0, none)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def chunk_prompt(args: argparse.Namespace, separator: str) -> ChunkPrompt:
    if args.template:
        return template_file(args.template)
    system = args.system
    if args.system_file:
        try:
            with open(args.system_file, encoding="utf-8") as fh:
                system = fh.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CorpusError(f"--system-file {args.system_file!r}: {exc}") from None
    system = DEFAULT_SYSTEM if system is None else system
    return shaped_template(args.prompt_shape, system, separator)


def main(args: argparse.Namespace) -> int:
    from lmcache_backend.commands import ingest_engine
    from lmcache_backend.config import ConfigError

    if args.batch < 1:
        print("lmcache-backend ingest: --batch must be >= 1", file=sys.stderr)
        return 2
    if args.staleness_probes < 0:
        print("lmcache-backend ingest: --staleness-probes must be >= 0", file=sys.stderr)
        return 2
    try:
        chunks = read_corpus(args.corpus)
        with ingest_engine.IngestEngine(args.model, args.dtype) as engine:
            prompt = chunk_prompt(args, engine.config.blend_special_str)
            jobs = plan(chunks, prompt, engine.tokenizer, engine.pattern, engine.keys_of)
            probes: list[list[int]] = []
            if args.staleness_probes:
                probes = probe_prompts(
                    jobs,
                    probe_contexts(chunks, args.staleness_probes),
                    args.staleness_probes,
                    prompt,
                    engine.tokenizer,
                    engine.config.blend_special_str,
                )
                engine.probes = args.staleness_probes
            longest = max(len(ids) for ids in [job.token_ids for job in jobs] + probes)
            engine.max_model_len = longest + 1
            print(f"{len(jobs)} chunks; tiers kept: {', '.join(engine.lasting)}", file=sys.stderr)
            from tqdm import tqdm

            with tqdm(
                total=len(jobs), unit="chunk", disable=args.no_progress, file=sys.stderr
            ) as bar:
                summary = run(
                    jobs,
                    engine.prefill,
                    engine.persisted,
                    engine.bytes_per_token(),
                    args.batch,
                    bar.update,
                )
            probe_line = None
            if probes and not summary.failed:
                with tqdm(
                    total=len(probes), unit="probe", disable=args.no_progress, file=sys.stderr
                ) as bar:
                    seconds = run_probes(probes, engine.probe, args.batch, bar.update)
                probe_line = (
                    f"staleness probes: {len(probes)} prompts in {seconds:.1f} s; each entry "
                    f"holds {engine.prior_bytes_per_token()} bytes a token of prior"
                )
    except (CorpusError, ConfigError, FileNotFoundError) as exc:
        print(f"lmcache-backend ingest: {exc}", file=sys.stderr)
        return 2
    print(summary.line())
    if probe_line:
        print(probe_line)
    if summary.failed:
        shown = ", ".join(summary.failed[:5]) + (" ..." if len(summary.failed) > 5 else "")
        print(f"not stored (see the warnings above; run again to retry): {shown}", file=sys.stderr)
        return 1
    return 0


def register(sub: Any) -> None:
    """The ``ingest`` subcommand of ``lmcache-backend``."""
    p = sub.add_parser(
        "ingest",
        help="encode a corpus ahead of time into the shared tiers (Redis, disk) for every engine",
    )
    add_arguments(p)
    p.set_defaults(func=main)
