"""The CacheBlend paper's own RAG data as a benchmark set: ``--dataset musique[@PASSAGES]``.

The CacheBlend authors evaluate on a MuSiQue file of 150 multi-hop questions, each with 10
retrieved passages (~600 tokens each), published in their repository
(github.com/YaoJiayi/CacheBlend, ``inputs/musique_s.json``). The package ships that file as it is
there, gzip-compressed, so the set works offline (``lmcache_backend/data/musique_s.json.gz``; its
origin and licence, MuSiQue's CC BY 4.0 and Wikipedia's CC BY-SA, are in ``musique_s.NOTICE``
beside it). Another file in the same format is read from its path,
``--dataset path/to/file.json[.gz][@PASSAGES]`` (all its examples).

Each example becomes a :class:`~lmcache_backend.data.examples.RagExample` posed as the paper's
``example/blend_musique.py`` poses it: the paper's instruction as the system part, the first
``PASSAGES`` passages (all 10 by default) as chunks, and the paper's query template around the
question, ending in ``Answer:``. The paper's separators between those parts (blank lines) are
replaced by ``blend_special_str``, which is how a CacheBlend deployment marks its chunks.

Examples 0-99 are held out: ``musique`` is examples 100-149 (the set to develop on),
``musique-heldout`` examples 0-99 (to check a default chosen on the first, once).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from lmcache_backend.data.examples import DatasetError, RagExample

#: the shipped file, gzip-compressed, in the package's data folder
FILE_NAME = "musique_s.json.gz"
#: where the authors publish the file (commit 55ad026 of their repository)
SOURCE_URL = "https://github.com/YaoJiayi/CacheBlend/blob/main/inputs/musique_s.json"
#: ``--dataset`` names: the examples each takes, by index in the file
SPLITS = {"musique": range(100, 150), "musique-heldout": range(0, 100)}

#: The paper's instruction before the passages (``prefix_prompt`` in its example scripts).
PAPER_INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the "
    "question based on the given passages. Do NOT repeat the question. The answer should be "
    "within 5 words..\nPassages:\n"
)
#: The paper's query template after the passages (``query_prompt``; its leading blank lines,
#: the paper's separator, are left to ``blend_special_str``).
PAPER_QUERY = (
    "Answer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words. \nQuestion:"
)


def default_path() -> Path:
    """The shipped file (``--dataset musique`` and ``musique-heldout`` read it)."""
    return Path(__file__).resolve().parents[2] / "data" / FILE_NAME


def is_musique(dataset: str) -> bool:
    """Whether ``--dataset`` names this set: ``musique``, ``musique-heldout`` or a ``.json``
    (``.json.gz``) file in the paper's format, each optionally with ``@PASSAGES``."""
    base = str(dataset).rpartition("@")[0] if "@" in str(dataset) else str(dataset)
    return base in SPLITS or base.endswith((".json", ".json.gz"))


def paper_question(question: str) -> str:
    """The paper's ``normalize_question``: a question mark at the end, the first letter in
    lower case."""
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return question[0].lower() + question[1:]


def paper_example(raw: dict, index: int, passages: int, where: str) -> RagExample:
    """One entry of the paper's file as an example of its first ``passages`` passages."""
    try:
        ctxs, question, answers = raw["ctxs"], raw["question"], raw["answers"]
        chunks = [
            f"{c['title'].strip()}\n\n{c['text'].strip()}" if c.get("title") else c["text"].strip()
            for c in ctxs[:passages]
        ]
    except (KeyError, TypeError) as exc:
        raise DatasetError(
            f"{where}: entry {index} is not in the paper's format (missing {exc})"
        ) from None
    if len(chunks) < passages:
        raise DatasetError(f"{where}: entry {index} has {len(chunks)} passages, {passages} asked")
    return RagExample(
        id=f"musique-{index}",
        system=PAPER_INSTRUCTION,
        chunks=chunks,
        question=f"{PAPER_QUERY}{paper_question(question)}\nAnswer:",
        answers=[str(a) for a in answers],
    )


def read_text(path: Path) -> str:
    """The text of ``path``, decompressed when its name ends in ``.gz``."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return fh.read()
    return path.read_text(encoding="utf-8")


def load_musique(dataset: str) -> list[RagExample]:
    """The examples ``--dataset`` names (see the module docstring).

    Raises:
        DatasetError: the file cannot be read or is not the paper's format, or ``@PASSAGES``
            is not a count from 2 to 10.
    """
    base, at, count = str(dataset).rpartition("@") if "@" in str(dataset) else (dataset, "", "")
    passages = 10
    if at:
        if not count.isdigit() or not 2 <= int(count) <= 10:
            raise DatasetError(
                f"--dataset {dataset!r}: expected @PASSAGES from 2 to 10 (the passages of each "
                "example, kept in the file's order)"
            )
        passages = int(count)
    path, indices = (default_path(), SPLITS[base]) if base in SPLITS else (Path(base), None)
    try:
        raw = json.loads(read_text(path))
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"--dataset {dataset!r}: cannot read {path} ({exc})") from None
    if not isinstance(raw, list) or not raw:
        raise DatasetError(f"{path}: expected the paper's format, a JSON list of examples")
    indices = range(len(raw)) if indices is None else indices
    if indices.stop > len(raw):
        raise DatasetError(f"{path}: holds {len(raw)} examples, {base} needs {indices.stop}")
    return [paper_example(raw[i], i, passages, str(path)) for i in indices]
