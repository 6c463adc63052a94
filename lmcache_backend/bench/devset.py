"""The quality dev set: synthetic RAG QA examples calibrated on the embedded model.

``python -m lmcache_backend.bench.devset --out lmcache_backend/data/devset.jsonl`` regenerates
the shipped file (``lmcache-backend bench --dataset dev`` reads it). Candidates are fictional
profiles (same-type distractor chunks: every chunk is a profile with the same kinds of facts) and
one question about one fact of one profile. A candidate is kept only if the model

* answers it correctly from its gold chunk alone (the fact is within the model's reach), and
* answers it wrongly with no context (the model cannot guess it),

so every kept example measures whether the context reached the answer. The candidates come from a
seed disjoint from the built-in set's; the calibration is greedy and deterministic, so the file is
reproducible on one torch build.

``--seed N`` draws the candidates from another seed: a held-out set to check that a default
chosen on the dev set carries over, e.g. ``--seed 424242 --want 40 --out /tmp/heldout.jsonl``
(then ``lmcache-backend bench --dataset /tmp/heldout.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from lmcache_backend.bench.metrics import answer_correct
from lmcache_backend.data.examples import RagExample, builtin_examples

DEVSET_PATH = Path(__file__).resolve().parent.parent / "data" / "devset.jsonl"
CANDIDATE_SEED = 7331  # the built-in set uses 2024
MIN_CHUNKS, MAX_CHUNKS = 4, 6  # ~750 to ~1,100 prompt tokens with SmolLM2's tokenizer

Answer = Callable[[str, list[str], str], str]  # (system, chunks, question) -> greedy answer


def gold_chunk(example: RagExample) -> str:
    """The profile the question is about (its name appears in the question)."""
    for chunk in example.chunks:
        name = chunk.split(".", 1)[0].removeprefix("Profile of ")
        if name in example.question:
            return chunk
    raise ValueError(f"{example.id}: no chunk is about the question {example.question!r}")


def candidates(count: int, seed: int = CANDIDATE_SEED) -> list[RagExample]:
    """``count`` candidate examples with 4 to 6 chunks each, ids ``dev-NNN``."""
    out = []
    for i, ex in enumerate(builtin_examples(count=count, seed=seed)):
        chunks = ex.chunks
        if len(chunks) < MIN_CHUNKS:  # builtin draws 3 to 6 chunks; pad with the next profiles
            extra = builtin_examples(count=1, chunks_per_example=MAX_CHUNKS, seed=seed + 1 + i)
            names = {c.split(".", 1)[0] for c in chunks}
            chunks = chunks + [c for c in extra[0].chunks if c.split(".", 1)[0] not in names]
            chunks = chunks[:MIN_CHUNKS]
        out.append(RagExample(f"dev-{i:03d}", ex.system, chunks, ex.question, list(ex.answers)))
    return out


def calibrate(
    examples: Iterable[RagExample], answer: Answer, want: int | None = None
) -> list[RagExample]:
    """The examples answered correctly from the gold chunk alone and wrongly with no context;
    stops after ``want`` kept examples."""
    kept = []
    for ex in examples:
        if not answer_correct(answer(ex.system, [gold_chunk(ex)], ex.question), ex.answers):
            continue
        if answer_correct(answer(ex.system, [], ex.question), ex.answers):
            continue
        kept.append(ex)
        if want is not None and len(kept) >= want:
            break
    return kept


def hf_answer(max_new_tokens: int = 16) -> Answer:
    """Greedy answers of the embedded model (HF transformers, fp32) to a plain chat prompt."""
    import torch

    from lmcache_backend.blend.segmenting import build_blend_prompt
    from lmcache_backend.data.embedded import load_embedded_model

    model, tokenizer = load_embedded_model()
    stop = {tokenizer.eos_token_id}

    @torch.no_grad()
    def answer(system: str, chunks: list[str], question: str) -> str:
        ids = build_blend_prompt(tokenizer, system, chunks, question).token_ids
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(stop),
            pad_token_id=tokenizer.eos_token_id,
        )
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    return answer


def write_jsonl(examples: Iterable[RagExample], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(json.dumps(asdict(ex), ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEVSET_PATH)
    parser.add_argument("--candidates", type=int, default=400)
    parser.add_argument("--want", type=int, default=120, help="stop after this many kept")
    parser.add_argument(
        "--seed", type=int, default=CANDIDATE_SEED, help="candidate seed (another one: held out)"
    )
    args = parser.parse_args(argv)
    pool = candidates(args.candidates, seed=args.seed)
    kept = calibrate(pool, hf_answer(), args.want)
    write_jsonl(kept, args.out)
    print(f"kept {len(kept)} examples -> {args.out}", file=sys.stderr)
    return 0 if kept else 1


if __name__ == "__main__":
    raise SystemExit(main())
