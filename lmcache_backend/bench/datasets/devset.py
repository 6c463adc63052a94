"""The quality dev set: synthetic RAG QA examples calibrated on the embedded model.

``python -m lmcache_backend.bench.datasets.devset [--model NAME]`` regenerates an embedded model's
shipped file (``lmcache-backend bench [--model NAME] --dataset dev`` reads it):
``data/devset.jsonl`` for SmolLM2, ``data/devset-gemma3-270m.jsonl`` for Gemma 3 270M, each
calibrated on its own model with the prompt shape its benchmarks use (a chat for SmolLM2-Instruct;
plain text ending in ``Answer:`` for the pretrained Gemma). ``--model PATH --out FILE`` calibrates
one for another model. Candidates are fictional
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

from lmcache_backend.bench.quality.metrics import answer_correct
from lmcache_backend.blend.segmenting import PROMPT_SHAPES
from lmcache_backend.data.embedded import embedded_spec, is_embedded_name
from lmcache_backend.data.examples import DatasetError, RagExample, builtin_examples

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DEVSET_PATH = DATA_DIR / "devset.jsonl"  # SmolLM2's
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


def devset_path(model: str | None = None) -> Path:
    """The shipped dev set of ``model`` (an embedded model's name; None: the default one).

    Raises:
        DatasetError: no dev set ships for that model (the message says how to make one).
    """
    if model is None or is_embedded_name(model):
        return DATA_DIR / embedded_spec(model).devset
    raise DatasetError(
        f"--dataset dev: no calibrated dev set ships for --model {model!r}; make one with "
        f"`python -m lmcache_backend.bench.datasets.devset --model {model} --out FILE` and pass "
        "--dataset FILE"
    )


def prompt_shape_for(model: str | None = None) -> str:
    """The prompt shape the benchmarks use for ``model``: the embedded model's own, else
    ``separator`` (a chat)."""
    if model is None or is_embedded_name(model):
        return embedded_spec(model).prompt_shape
    return "separator"


def hf_answer(
    max_new_tokens: int = 16, model_name: str | None = None, shape: str | None = None
) -> Answer:
    """Greedy answers of a model (HF transformers, fp32; default: the embedded SmolLM2) to an
    example posed in ``shape`` (default: the model's, :func:`prompt_shape_for`)."""
    import torch

    from lmcache_backend.blend.segmenting import shaped_prompt
    from lmcache_backend.data.embedded import load_embedded_model

    model, tokenizer = load_embedded_model(name=model_name)
    shape = shape or prompt_shape_for(model_name)
    stop = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)  # an id or a list
    stop.update([configured] if isinstance(configured, int) else configured or [])

    @torch.no_grad()
    def answer(system: str, chunks: list[str], question: str) -> str:
        ids = shaped_prompt(tokenizer, shape, system, chunks, question)
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
    parser.add_argument(
        "--model", default=None, help="embedded model name or model folder (default: smollm2)"
    )
    parser.add_argument(
        "--prompt-shape", choices=PROMPT_SHAPES, default=None, help="default: the model's"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: the embedded model's shipped file"
    )
    parser.add_argument("--candidates", type=int, default=400)
    parser.add_argument("--want", type=int, default=120, help="stop after this many kept")
    parser.add_argument(
        "--seed", type=int, default=CANDIDATE_SEED, help="candidate seed (another one: held out)"
    )
    args = parser.parse_args(argv)
    try:
        out = args.out or devset_path(args.model)
    except DatasetError as exc:
        parser.error(f"{exc} (or give --out FILE)")
    pool = candidates(args.candidates, seed=args.seed)
    answer = hf_answer(model_name=args.model, shape=args.prompt_shape)
    kept = calibrate(pool, answer, args.want)
    write_jsonl(kept, out)
    print(f"kept {len(kept)} examples -> {out}", file=sys.stderr)
    return 0 if kept else 1


if __name__ == "__main__":
    raise SystemExit(main())
