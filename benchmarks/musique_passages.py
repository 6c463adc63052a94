"""Which properties of real passages go with a blend's distance from full prefill.

Reads the JSON of a ``lmcache-backend bench --dataset musique[@N] --json FILE`` run and, for
each example, measures three properties of its passages that could make cached K/V a poor
stand-in for full prefill's:

* ``cut_starts``: passages that start where the retriever cut the text (at punctuation or with
  a WordPiece continuation mark ``##``): their first tokens had no sentence start when cached;
* ``shared_names``: the share of each passage's rare words (entity-like: found in the passages of
  at most 2 of the split's questions) that another passage of the prompt also holds, mean over
  passages: text that cross-passage attention links, which a chunk cached alone never saw;
* ``question_names``: the share of the question's rare words found in the passages: how
  grounded an answer can be.

It prints each property's range and its Spearman rank correlation (ties averaged) with every
strategy's answer KL and F1 to full prefill's answer, over the run's examples. A property
behind the distance correlates positively with the KL and negatively with the F1.

    python benchmarks/musique_passages.py out/musique.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter
from collections.abc import Sequence

from lmcache_backend.bench.datasets.musique import load_musique

RARE_AT_MOST = 2  # questions of the split whose ten passages hold the word
_STOP = frozenset(
    "the a an of and or in on at to for from by with as is was were be been are this that which "
    "who whom his her its their it he she they also after before into over under than then there "
    "what when where".split()
)


def content_words(text: str) -> set[str]:
    """Lower-case words of four letters or more, stop words left out."""
    return {w for w in re.findall(r"[a-z][a-z'\-]+", text.lower()) if len(w) > 3} - _STOP


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 0, tied values sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            out[order[k]] = (start + end) / 2
        start = end + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation; NaN when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)
    return cov / var**0.5 if var else float("nan")


def passage_properties(chunks: Sequence[str], question: str, df: Counter) -> dict[str, float]:
    """The three properties of one prompt's passages (see the module docstring); ``df``
    counts, for each word, the questions of the split whose passages hold it."""
    texts = [c.split("\n\n", 1)[-1].lstrip() for c in chunks]  # without the title
    rare = [{w for w in content_words(c) if df[w] <= RARE_AT_MOST} for c in chunks]
    shared = [
        len(words & set().union(*(rare[j] for j in range(len(rare)) if j != k))) / len(words)
        for k, words in enumerate(rare)
        if words
    ]
    asked = {w for w in content_words(question) if df[w] <= RARE_AT_MOST}
    return {
        "cut_starts": sum(t[:1] in ".,;:)" or t.startswith("##") for t in texts),
        "shared_names": statistics.fmean(shared) if shared else 0.0,
        "question_names": len(asked & set().union(*rare)) / len(asked) if asked else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the JSON of a bench run on a musique dataset")
    args = parser.parse_args(argv)
    run = json.loads(open(args.run, encoding="utf-8").read())
    dataset = run["args"]["dataset"]
    examples = {ex.id: ex for ex in load_musique(dataset)}
    every = load_musique(dataset.rpartition("@")[0] or dataset)  # all ten passages
    df = Counter(w for ex in every for w in set().union(*map(content_words, ex.chunks)))
    cases = [c for c in run["examples"] if c["id"] in examples]
    if len(cases) < 3:
        sys.exit(f"{args.run}: {len(cases)} examples of {dataset}; need at least 3")
    props = [passage_properties(examples[c["id"]].chunks, examples[c["id"]].question, df)
             for c in cases]  # fmt: skip
    strategies = [o["strategy"] for o in cases[0]["outcomes"]][1:]  # full prefill first
    print(f"{len(cases)} examples of {dataset}; Spearman with answer KL / F1 to full's answer")
    for name in props[0]:
        values = [p[name] for p in props]
        print(f"{name}: mean {statistics.fmean(values):.2f}, {min(values):.2f}-{max(values):.2f}")
        for strategy in strategies:
            outs = [next(o for o in c["outcomes"] if o["strategy"] == strategy) for c in cases]
            kl = spearman(values, [o["answer_kl"] for o in outs])
            f1 = spearman(values, [o["fidelity_f1"] for o in outs])
            print(f"    {strategy:<36} {kl:+.2f} / {f1:+.2f}")


if __name__ == "__main__":
    main()
