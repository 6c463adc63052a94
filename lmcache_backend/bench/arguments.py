"""The ``lmcache-backend bench`` flags: each parsed with the settings registry's own parsers where
it sets a setting, so a bad value names the flag and the value."""

from __future__ import annotations

import argparse

from lmcache_backend.bench.datasets.dataset import DEFAULT_COUNT
from lmcache_backend.bench.quality.engine_choice import (
    ENGINE_CHOICES,
)
from lmcache_backend.bench.quality.runner import (
    WARM_MODES,
)
from lmcache_backend.bench.quality.strategies import (
    parse_ints,
    parse_schedule,
)
from lmcache_backend.blend.segmenting import PROMPT_SHAPES
from lmcache_backend.config import SELECTION_CHOICES
from lmcache_backend.settings.arguments import parse_option, setting_type


def _arg(parse):
    """An argparse ``type`` that turns our ValueErrors into usage errors."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _selections(text: str) -> list[str]:
    if text.strip() == "all":
        return list(SELECTION_CHOICES)
    return parse_option("blend_selection", text, "list")


def _warm(text: str) -> str:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in (*WARM_MODES, "auto")]
    if bad or not modes or ("auto" in modes and len(modes) > 1) or len(set(modes)) < len(modes):
        raise ValueError(
            f"--warm {text!r}: give auto, or one or both of {', '.join(WARM_MODES)} "
            "separated by a comma"
        )
    return ",".join(modes)


def warm_modes(warm: str, dataset: str | None) -> list[str]:
    """The store fillings ``--warm`` asks for, in order; ``auto``: chunks encoded alone
    (``ingest``) for the MuSiQue sets (real RAG over a pre-encoded corpus, CacheBlend's own
    setting), an earlier request (``request``) for the others."""
    from lmcache_backend.bench.datasets.musique import is_musique

    if warm == "auto":
        return ["ingest"] if dataset and is_musique(str(dataset)) else ["request"]
    return warm.split(",")


def _schedule(text: str):
    return None if text.strip().lower() == "none" else parse_schedule(text)


#: how each store filling is named above its table
WARM_LABELS = {
    "ingest": "ingest (each chunk computed alone after the system part)",
    "request": "an earlier request (the chunks in order, another question)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` flags."""
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="hf",
        help="serving engine (default: hf, transformers on this machine)",
    )
    parser.add_argument(
        "--model",
        metavar="PATH|NAME",
        default=None,
        help="model folder, hub name or embedded model (smollm2, gemma3-270m; default: smollm2)",
    )
    parser.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        help="RAG examples, one JSON object a line; 'dev' for the shipped dev set; "
        "'musique[@PASSAGES]' for the CacheBlend paper's MuSiQue examples 100-149 with their "
        "first PASSAGES passages (default 10; 'musique-heldout': examples 0-99) "
        "(default: the built-in set)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help=f"use the first N examples (built-in set: {DEFAULT_COUNT})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds per prompt, after one untimed run (default: 3; 0: quality only, "
        "TTFT from the untimed runs)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, help="greedy answer length (default: 16)"
    )
    parser.add_argument(
        "--ratios",
        type=setting_type("blend_recompute_ratios"),
        default=[0.05, 0.15, 0.3],
        help="CacheBlend ratios, one strategy each (default: 0.05,0.15,0.3)",
    )
    parser.add_argument(
        "--check-layers",
        type=setting_type("blend_check_layers"),
        default=[1],
        help="check layers of those strategies; one ratio applies at each (default: 1)",
    )
    parser.add_argument(
        "--selections",
        type=_arg(_selections),
        default=[None],
        help="token selectors (blend_selection), one strategy set each, e.g. "
        "kv_deviation,query_attention; 'all' for every one (default: the configured one)",
    )
    parser.add_argument(
        "--read-shares",
        type=setting_type("blend_min_read_share", "list"),
        default=[],
        help="the fidelity knob (blend_min_read_share) on top of each ratio, one strategy per "
        "value, e.g. 0.6,0.8 (default: none)",
    )
    parser.add_argument(
        "--max-divergences",
        type=setting_type("blend_max_divergence", "list"),
        default=[],
        help="the divergence knob (blend_max_divergence) on top of each ratio, one strategy per "
        "value, e.g. 0.05,0.1 (default: none)",
    )
    parser.add_argument(
        "--oracle-ratios",
        type=setting_type("blend_recompute_ratios"),
        default=[],
        help="HF engine: recompute this share of the reusable tokens chosen by their true K/V "
        "deviation from full prefill (a bound on selection rules), one strategy each",
    )
    parser.add_argument(
        "--gradual",
        type=_arg(_schedule),
        action="append",
        metavar="L:R",
        help="gradual filtering as one more strategy: check layers and a ratio "
        "per layer, e.g. 1,2:0.3,0.15 (the default); repeatable; 'none' for none",
    )
    parser.add_argument(
        "--epic-k",
        type=int,
        default=16,
        help="EPIC baseline: first k tokens of each chunk recomputed "
        "(default: 16; 0 leaves it out)",
    )
    parser.add_argument(
        "--prefix-block",
        type=int,
        default=16,
        help="prefix-caching block size in tokens, as vLLM's (default: 16; 1 = any token; "
        "0 leaves prefix caching out)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time every strategy over context lengths and chunk counts",
    )
    parser.add_argument(
        "--sweep-tokens",
        type=_arg(parse_ints),
        default=[1000, 2000, 4000],
        help="sweep context lengths (default: 1000,2000,4000)",
    )
    parser.add_argument(
        "--sweep-chunks",
        type=_arg(parse_ints),
        default=[3, 6, 12],
        help="sweep chunk counts, at the middle length (default: 3,6,12); the "
        "lengths use the middle count",
    )
    parser.add_argument(
        "--sweep-repeats", type=int, default=2, help="timed rounds per sweep prompt (default: 2)"
    )
    parser.add_argument(
        "--sweep-only", action="store_true", help="run the sweep alone, without the dataset"
    )
    parser.add_argument(
        "--prompt-shape",
        choices=PROMPT_SHAPES,
        default=None,
        help="separator: a chat with the parts after blend_special_str; stock: LangChain's "
        "stock RAG chat (chunks joined by blank lines in the system message, no separator); "
        "text: the separated parts as completions text ending in 'Answer:' (pretrained models) "
        "(default: the embedded model's own, else separator)",
    )
    parser.add_argument(
        "--warm",
        type=_arg(_warm),
        default="auto",
        help="how the store is filled before each example: ingest (each chunk computed alone "
        "after the system part, as lmcache-backend ingest encodes a corpus), request (an "
        "earlier request with the chunks in order), or both as ingest,request (each strategy "
        "once per setting); auto: ingest for the MuSiQue sets, request for the others "
        "(default: auto)",
    )
    parser.add_argument(
        "--staleness-probes",
        type=int,
        default=0,
        metavar="K",
        help="with chunks encoded alone (ingest): compute each stored chunk after K probe "
        "contexts (passages of other examples) and store its staleness prior, as "
        "lmcache-backend ingest --staleness-probes does (default: 0, none)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every number as JSON")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead: where a blended request's time goes in vLLM, per prompt size, against "
        "full prefill on the same engine (python -m lmcache_backend.bench.profiling.profile; takes "
        "--model, --prompt-shape, "
        "--repeats and --sweep-tokens)",
    )
    from lmcache_backend.bench.frameworks import clients
    from lmcache_backend.bench.load_test import run as load

    clients.add_arguments(parser)
    load.add_arguments(parser)
