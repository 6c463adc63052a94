"""Command-line flags of ``lmcache-backend bench`` and the run they drive."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lmcache_backend.bench.arguments import WARM_LABELS, warm_modes
from lmcache_backend.bench.datasets.dataset import DEFAULT_COUNT, load_dataset
from lmcache_backend.bench.datasets.devset import prompt_shape_for
from lmcache_backend.bench.quality.engine_choice import (
    EngineUnavailable,
    create_engine,
)
from lmcache_backend.bench.quality.engines import BenchEngine
from lmcache_backend.bench.quality.report import (
    LEGEND,
    case_dicts,
    format_sweep,
    format_table,
    summarize,
)
from lmcache_backend.bench.quality.runner import (
    SweepPoint,
    run_examples,
    run_sweep,
    steps_per_case,
)
from lmcache_backend.bench.quality.strategies import (
    Strategy,
    build_strategies,
    parse_schedule,
)
from lmcache_backend.config import BlendConfig, ConfigError
from lmcache_backend.data.examples import DatasetError


def strategies_from_args(args: argparse.Namespace) -> list[Strategy]:
    """The strategies the flags ask for."""
    schedules = args.gradual if args.gradual is not None else [parse_schedule("1,2:0.3,0.15")]
    return build_strategies(
        ratios=args.ratios,
        check_layers=args.check_layers,
        schedules=[s for s in schedules if s is not None],
        epic_k=args.epic_k,
        prefix_block=args.prefix_block,
        include_prefix=args.prefix_block > 0,
        selections=args.selections,
        read_shares=args.read_shares,
        oracle_ratios=args.oracle_ratios,
        max_divergences=args.max_divergences,
    )


def sweep_points(tokens: list[int], chunks: list[int]) -> tuple[list[SweepPoint], list[SweepPoint]]:
    """Lengths at the middle chunk count, and chunk counts at the middle length."""
    mid_chunks = sorted(chunks)[len(chunks) // 2]
    mid_tokens = sorted(tokens)[len(tokens) // 2]
    return (
        [SweepPoint(t, mid_chunks) for t in tokens],
        [SweepPoint(mid_tokens, c) for c in chunks],
    )


def _validate(args: argparse.Namespace, num_layers: int) -> None:
    schedules = [("--check-layers", args.check_layers)]
    schedules += [("--gradual", s[0]) for s in (args.gradual or []) if s is not None]
    for flag, layers in schedules:  # each must exist in the model: the configuration's rule
        config = BlendConfig(blend_check_layers=list(layers), sources={"blend_check_layers": flag})
        try:
            config.validate_for_model(num_layers)
        except ConfigError as exc:
            raise SystemExit(f"bench: {exc}") from None
    if args.repeats < 0:
        raise SystemExit("bench: --repeats must be >= 0 (0: quality only)")
    if args.sweep_repeats < 1:
        raise SystemExit("bench: --sweep-repeats must be >= 1")
    if args.staleness_probes < 0:
        raise SystemExit("bench: --staleness-probes must be >= 0")


def run(
    args: argparse.Namespace, config=None, out=sys.stdout, engine: BenchEngine | None = None
) -> dict[str, Any]:
    """Run the benchmark the flags describe; print the tables and return every number.

    ``config`` overrides the CacheBlend settings of the engine ``--engine`` names; ``engine``
    replaces that engine altogether (any object with the :class:`BenchEngine` interface).
    """
    from tqdm import tqdm

    try:
        examples = load_dataset(
            args.dataset, args.limit or DEFAULT_COUNT, getattr(args, "model", None)
        )
    except (DatasetError, OSError) as exc:
        raise SystemExit(f"bench: {exc}") from None
    if args.limit:
        examples = examples[: args.limit]
    if args.sweep_only:
        args.sweep, examples = True, []
    strategies = strategies_from_args(args)
    try:
        engine = engine or create_engine(args.engine, config, getattr(args, "model", None))
    except EngineUnavailable as exc:
        raise SystemExit(f"bench: {exc}") from None
    _validate(args, engine.num_layers)
    engine.prompt_shape = getattr(args, "prompt_shape", None) or prompt_shape_for(
        getattr(args, "model", None)
    )
    skipped = [s.name for s in strategies if not engine.supports(s)]
    strategies = [s for s in strategies if engine.supports(s)]
    by_length, by_chunks = sweep_points(args.sweep_tokens, args.sweep_chunks)
    # Each distinct prompt size runs once; the middle one belongs to both sweeps.
    points = list(dict.fromkeys(by_length + by_chunks)) if args.sweep else []
    setup = {**engine.describe(), "cpu_count": os.cpu_count(), "load_before": os.getloadavg()}
    print(
        f"{setup['model']} on {args.engine} ({setup['dtype']}, ops {setup['ops_backend']}, "
        f"{setup['threads']} threads, load {setup['load_before'][0]:.2f}): {len(strategies)} "
        f"strategies on {len(examples)} prompts (1 untimed + {args.repeats} timed runs each)"
        + (f" and {len(points)} sweep sizes (1 + {args.sweep_repeats})" if points else ""),
        file=out,
    )
    if skipped:
        print(f"--engine {args.engine} cannot run: {', '.join(skipped)}", file=out)
    modes = warm_modes(args.warm, args.dataset)
    total = len(modes) * len(examples) * steps_per_case(strategies, args.repeats)
    total += len(points) * steps_per_case(strategies, args.sweep_repeats)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    examples_out: list[dict[str, Any]] = []
    with tqdm(total=total, unit="prefill", disable=args.no_progress, file=sys.stderr) as bar:
        for mode in modes if examples else []:
            probes = args.staleness_probes if mode == "ingest" else 0
            cases = run_examples(
                engine,
                strategies,
                examples,
                args.repeats,
                args.max_new_tokens,
                bar.update,
                mode,
                probes,
            )
            mode_rows = summarize(cases, strategies)
            for row in mode_rows:
                row["warm"] = mode
                if len(modes) > 1:
                    row["strategy"] += f" [{mode}]"
            warm_s = sum(c.warm_s for c in cases) / len(cases)
            probed = f", {probes} staleness probes each" if probes else ""
            print(
                f"\nchunks stored by {WARM_LABELS[mode]}{probed}; the store filled in "
                f"{warm_s:.1f} s per example:",
                file=out,
            )
            print(format_table(mode_rows), file=out)
            rows += mode_rows
            examples_out += [dict(case, warm=mode) for case in case_dicts(cases)]
        swept = dict(
            zip(points, run_sweep(engine, strategies, points, args.sweep_repeats, bar.update))
        )
    setup.update(load_after=os.getloadavg(), wall_s=time.perf_counter() - started)
    if rows:
        print(LEGEND, file=out)
    result: dict[str, Any] = {
        "setup": setup,
        "args": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "warm": modes,
        "strategies": rows,
        "examples": examples_out,
        "sweep": None,
    }
    if args.sweep:
        sweeps = {
            "by_length": ("context length", [swept[p] for p in by_length]),
            "by_chunks": ("number of chunks", [swept[p] for p in by_chunks]),
        }
        for label, sweep_cases in sweeps.values():
            print(f"\nTTFT by {label}, ms (ratio to full prefill):", file=out)
            print(format_sweep(sweep_cases, strategies), file=out)
        result["sweep"] = {"repeats": args.sweep_repeats} | {
            key: case_dicts(sweep_cases) for key, (_, sweep_cases) in sweeps.items()
        }
    print(f"finished in {setup['wall_s']:.0f} s, load {setup['load_after'][0]:.2f}", file=out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2, default=str)
    if args.plots:
        from lmcache_backend.bench.quality.plots import write_plots

        for path in write_plots(result, args.plots):
            print(f"wrote {path}", file=out)
    return result


def main(args: argparse.Namespace) -> int:
    """Entry point of ``lmcache-backend bench``."""
    if getattr(args, "load", False):
        from lmcache_backend.bench.load_test import run as load

        load.run(args)
        return 0
    if getattr(args, "client", None):
        from lmcache_backend.bench.frameworks import clients

        clients.run(args)
        return 0
    import torch

    # Threads beyond the cores make CPU runs far slower; follow OMP_NUM_THREADS when set.
    from lmcache_backend.settings import read_variable

    threads = read_variable("OMP_NUM_THREADS") or os.cpu_count() or 1
    torch.set_num_threads(threads)
    if args.profile:
        from lmcache_backend.bench.profiling import profile

        argv = ["--repeats", str(args.repeats)]
        if args.sweep_tokens:
            argv += ["--sizes", ",".join(str(t) for t in args.sweep_tokens)]
        if args.json:
            argv += ["--json", args.json]
        if args.model:
            argv += ["--model", args.model]
        if args.prompt_shape:
            argv += ["--shape", args.prompt_shape]
        profile.main(argv)
        return 0
    run(args)
    return 0
