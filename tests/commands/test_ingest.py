"""``lmcache-backend ingest``: the corpus and template forms, prompts tokenized exactly as a later
request holding the chunk, keys found by that request, a resumable and idempotent run, and the
command itself with a real vLLM engine against a real 3-primary Redis Cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmcache_backend.blend.segmenting import build_blend_prompt, shaped_prompt
from lmcache_backend.blend.segments.patterns import segment_pattern
from lmcache_backend.commands.corpus import (
    INGEST_QUESTION,
    CorpusError,
    read_corpus,
    shaped_template,
    template_file,
)
from lmcache_backend.commands.ingest import (
    DEFAULT_SYSTEM,
    plan,
    probe_contexts,
    probe_prompts,
    run,
    run_probes,
)
from lmcache_backend.data.examples import builtin_examples
from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage.segments import segment_keys

SEP = " # # "
FP = ModelFingerprint("TestLM", 30, 9, 3, 64, "rope", "torch.bfloat16", "w0")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lmcache_backend.data.embedded import embedded_model_path

    try:
        return AutoTokenizer.from_pretrained(str(embedded_model_path()))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _keys(ids, spans):
    return segment_keys(FP, ids, spans)


def test_corpus_forms(tmp_path) -> None:
    lines = [
        json.dumps("a bare string"),
        json.dumps({"id": "doc-1", "text": "a text field"}),
        json.dumps({"page_content": "LangChain's Document", "metadata": {}}),
        "",
        json.dumps({"id": "ex", "chunks": ["first of an example", "second of an example"]}),
        json.dumps({"text": "a text field"}),  # the same text again: one chunk
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    chunks = read_corpus(tmp_path / "c.jsonl")
    assert [c.id for c in chunks] == ["line 1", "doc-1", "line 3", "ex#0", "ex#1"]
    assert chunks[2].text == "LangChain's Document"
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("  second file \n")
    (folder / "sub" / "a.md").write_text("first file")
    (folder / "skip.pdf").write_text("not text")
    assert [(c.id, c.text) for c in read_corpus(folder)] == [
        ("b.txt", "second file"),
        ("sub/a.md", "first file"),
    ]


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "c.jsonl:1: not JSON"),
        ('{"title": "x"}', "c.jsonl:1: no field 'text'"),
        ('{"text": ""}', "must be a non-empty string"),
        ('{"chunks": []}', "'chunks' must be a non-empty list"),
        ("[1, 2]", "expected a string or an object"),
        ("", "holds no chunk"),
    ],
)
def test_corpus_errors_name_the_line_and_field(tmp_path, content, why) -> None:
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(CorpusError, match=why.replace("[", r"\[").replace("(", r"\(")):
        read_corpus(tmp_path / "c.jsonl")
    with pytest.raises(CorpusError, match="no such file"):
        read_corpus(tmp_path / "missing")


def test_template_files(tmp_path, tokenizer) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": f"{SEP}{{chunk}}{SEP}{{question}}"},
        ],
    }
    (tmp_path / "chat.json").write_text(json.dumps(body))
    chat = template_file(tmp_path / "chat.json")
    doc = "A text with {braces} and {chunk}-like words."
    expected = build_blend_prompt(tokenizer, "Answer from the documents.", [doc], INGEST_QUESTION)
    assert chat.token_ids(tokenizer, doc) == expected.token_ids
    (tmp_path / "plain.txt").write_text("Context: {chunk}\nAnswer:")
    plain = template_file(tmp_path / "plain.txt")
    assert plain.token_ids(tokenizer, "x") == tokenizer.encode("Context: x\nAnswer:")
    for bad in ("no placeholder", "{chunk} {chunk}", '{"messages": [{"role": 1}]}'):
        (tmp_path / "bad.txt").write_text(bad)
        with pytest.raises(CorpusError, match="template"):
            template_file(tmp_path / "bad.txt")


@pytest.mark.parametrize("shape", ["separator", "text", "stock"])
def test_ingest_prompts_are_the_prompts_the_package_builds(tokenizer, shape) -> None:
    prompt = shaped_template(shape, DEFAULT_SYSTEM, SEP)
    for chunk in builtin_examples(count=1, chunks_per_example=4)[0].chunks:
        expected = shaped_prompt(tokenizer, shape, DEFAULT_SYSTEM, [chunk], INGEST_QUESTION, SEP)
        assert prompt.token_ids(tokenizer, chunk) == expected


@pytest.mark.parametrize("shape", ["separator", "text"])
def test_probe_prompts_put_each_chunk_after_contexts_that_do_not_hold_it(tokenizer, shape) -> None:
    """``--staleness-probes K``: each chunk last, after K contexts of other corpus chunks, in
    the prompt the package builds for those chunks in that order (so the connector finds each
    of them as it stored it, and measures the last)."""
    from lmcache_backend.commands.corpus import Chunk

    texts = builtin_examples(count=1, chunks_per_example=7)[0].chunks
    chunks = [Chunk(f"c{i}", t) for i, t in enumerate(texts)]
    contexts = probe_contexts(chunks, 2, seed=3)
    assert len(contexts) == 3 and all(len(c) == 2 for c in contexts)
    assert len({c.id for context in contexts for c in context}) == 6, "no chunk in two"
    assert len(probe_contexts(chunks[:5], 2)) == 2, "as many as a small corpus holds"
    assert probe_contexts(chunks, 2, seed=3) == contexts, "the same sample every run"
    prompt = shaped_template(shape, DEFAULT_SYSTEM, SEP)
    jobs = plan(chunks, prompt, tokenizer, segment_pattern(tokenizer, SEP, 16, "auto"), _keys)
    prompts = probe_prompts(jobs, contexts, 2, prompt, tokenizer, SEP)
    assert len(prompts) == 2 * len(chunks)
    for job, pair in zip(jobs, zip(prompts[::2], prompts[1::2])):
        usable = [c for c in contexts if job.chunk not in c][:2]
        for ids, context in zip(pair, usable):
            texts_in_order = [c.text for c in context] + [job.chunk.text]
            expected = shaped_prompt(
                tokenizer, shape, DEFAULT_SYSTEM, texts_in_order, INGEST_QUESTION, SEP
            )
            assert ids == expected
    sent = []
    assert run_probes(prompts, sent.append, batch=4) >= 0
    assert [len(group) for group in sent] == [4, 4, 4, 2] and sum(sent, []) == prompts


@pytest.mark.parametrize(
    "shape, segmentation, least",
    [("separator", "auto", 1.0), ("text", "separator", 1.0), ("stock", "auto", 0.85)],
)
def test_a_later_request_finds_the_ingested_chunks(tokenizer, shape, segmentation, least) -> None:
    """A request holding ingested chunks in another order with a new question looks them up
    as the connector's scheduler does: every chunk unit is found (blocks: all but the edges)."""
    pattern = segment_pattern(tokenizer, SEP, 16, segmentation)
    example = builtin_examples(count=1, chunks_per_example=5, seed=3)[0]
    jobs = plan(
        [type("C", (), {"id": str(i), "text": c})() for i, c in enumerate(example.chunks)],
        shaped_template(shape, example.system, SEP),
        tokenizer,
        pattern,
        _keys,
    )
    stored = {k for job in jobs for k in job.keys}
    chunks = example.chunks[2:] + example.chunks[:2]
    asked = shaped_prompt(tokenizer, shape, example.system, chunks, "Who keeps bees?", SEP)

    def held(segments):
        return [k in stored for k in _keys(asked, [(s.start, s.end) for s in segments])]

    found = pattern.match(asked, held)
    covered = sum(len(s) for s in found)
    chunk_tokens = sum(len(tokenizer.encode(c, add_special_tokens=False)) for c in chunks)
    assert covered >= least * chunk_tokens, (covered, chunk_tokens)


class _Tiers:
    """The lasting tiers as a set of keys, filled by a prefill that stores each prompt's units
    (as the connector does); ``broken`` chunks' units are never stored."""

    def __init__(self, jobs, broken=()):
        self.keys: set[str] = set()
        self.units = {tuple(j.token_ids): j.keys for j in jobs}
        self.broken = {tuple(j.token_ids) for j in jobs if j.chunk.id in broken}
        self.prefilled = 0

    def prefill(self, prompts):
        self.prefilled += len(prompts)
        for ids in prompts:
            if tuple(ids) not in self.broken:
                self.keys.update(self.units[tuple(ids)])

    def persisted(self, keys):
        return [k in self.keys for k in keys]


def test_a_run_is_resumable_idempotent_and_counts_what_it_wrote(tokenizer) -> None:
    pattern = segment_pattern(tokenizer, SEP, 16, "auto")
    chunks = [
        type("C", (), {"id": f"c{i}", "text": c})()
        for i, c in enumerate(builtin_examples(count=1, chunks_per_example=6)[0].chunks)
    ]
    prompt = shaped_template("separator", DEFAULT_SYSTEM, SEP)
    jobs = plan(chunks, prompt, tokenizer, pattern, _keys)
    tiers = _Tiers(jobs, broken={"c4"})
    first = run(jobs[:3], tiers.prefill, tiers.persisted, {"redis": 10}, batch=2)  # interrupted
    assert (first.written, first.skipped, first.failed) == (3, 0, [])
    units = {k: n for job in jobs[:3] for k, n in zip(job.keys, job.lengths)}
    assert first.tokens == sum(units.values()), "the shared system part counts once"
    assert first.bytes_per_tier == {"redis": 10 * first.tokens}
    again = run(jobs, tiers.prefill, tiers.persisted, {"redis": 10}, batch=2)
    assert (again.written, again.skipped, again.failed) == (2, 3, ["c4"])
    assert tiers.prefilled == 3 + 3, "only the chunks not stored yet were computed"
    tiers.broken.clear()
    last = run(jobs, tiers.prefill, tiers.persisted, {"redis": 10})
    assert (last.written, last.skipped, last.failed) == (1, 5, [])
    done = run(jobs, tiers.prefill, tiers.persisted, {"redis": 10})
    assert (done.written, done.skipped, done.tokens) == (0, 6, 0)
    assert "ingested 0 of 6 chunks (6 already stored, 0 failed)" in done.line()


@pytest.mark.slow
def test_the_ingest_command_writes_a_corpus_into_a_cluster(tmp_path, tokenizer) -> None:
    """``lmcache-backend ingest`` with vLLM into a real 3-primary cluster; a second run writes
    nothing (and starts no engine); a later request's units are all there."""
    from redis_deployments import RedisClusterNodes
    from vllm_scripts import BLEND_ENV

    from lmcache_backend.storage.remote.tier import RedisTier

    examples = builtin_examples(count=2, chunks_per_example=4, seed=11)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"chunks": e.chunks}) for e in examples))
    cluster = RedisClusterNodes(tmp_path / "cluster")
    cluster.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
        env.update(BLEND_ENV, LMCACHE_REMOTE_URL=cluster.url)
        command = [sys.executable, "-m", "lmcache_backend", "ingest", str(corpus), "--no-progress"]
        first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, first.stderr[-3000:]
        assert "ingested 8 of 8 chunks (0 already stored, 0 failed)" in first.stdout
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert "ingested 0 of 8 chunks (8 already stored, 0 failed)" in second.stdout
        assert "Loading safetensors" not in second.stderr, "no engine for nothing to do"
        sizes = [s.client().dbsize() for s in cluster.servers]
        assert sum(sizes) == 9 and min(sizes) > 0  # 8 chunks + the system part, spread
        # a later request (another order, a new question): the keys its lookup computes, from
        # the fingerprint digest the entries carry (the unsalted key seed)
        stored = cluster.servers[0].client().randomkey()
        value = cluster.servers[0].client().get(stored)
        header = json.loads(value[8 : 8 + int.from_bytes(value[:8], "little")])
        seed = bytes.fromhex(header["__metadata__"]["fingerprint"])
        fingerprint = type("Digest", (), {"digest": lambda self: seed})()
        example = examples[1]
        asked = build_blend_prompt(tokenizer, DEFAULT_SYSTEM, example.chunks[::-1], "Who?")
        units = segment_pattern(tokenizer, SEP, 16, "auto").store_units(asked.token_ids)
        keys = segment_keys(fingerprint, asked.token_ids, [(u.start, u.end) for u in units])
        tier = RedisTier(cluster.url)
        assert len(keys) == 5 and tier.contains_many(keys) == [True] * 5
        tier.close()
    finally:
        cluster.stop()


@pytest.mark.slow
def test_ingest_with_staleness_probes_stores_each_chunk_with_its_prior(tmp_path) -> None:
    """``lmcache-backend ingest --staleness-probes 1`` with vLLM into a real Redis: the probes
    store nothing new; every chunk's entry then carries a staleness prior (a v2 entry whose
    prior has the layers x tokens of its K/V), the system part none."""
    from redis_server import RedisServer
    from vllm_scripts import BLEND_ENV

    from lmcache_backend.storage import serde

    examples = builtin_examples(count=1, chunks_per_example=7, seed=5)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"chunks": examples[0].chunks}) + "\n")
    server = RedisServer()
    server.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
        env.update(BLEND_ENV, LMCACHE_REMOTE_URL=server.url)
        command = [sys.executable, "-m", "lmcache_backend", "ingest", str(corpus),
                   "--no-progress", "--staleness-probes", "1"]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "ingested 7 of 7 chunks" in done.stdout and "staleness probes: 7 prompts" in (
            done.stdout
        ), done.stdout
        client = server.client()
        entries = [client.get(k) for k in client.keys("*")]
        assert len(entries) == 8, "7 chunks and the system part: the probes stored nothing"
        formats = []
        for value in entries:
            header = json.loads(value[8 : 8 + int.from_bytes(value[:8], "little")])
            meta = header["__metadata__"]
            formats.append(meta["format"])
            if meta["format"] == serde.FORMAT_V2:
                layers, tokens = json.loads(meta["shape"])[:2]
                assert header["staleness"]["shape"] == [layers, tokens]
                assert meta["context"] and json.loads(meta["preceding"])  # after the system
        assert sorted(formats) == [serde.FORMAT] + [serde.FORMAT_V2] * 7
    finally:
        server.stop()
