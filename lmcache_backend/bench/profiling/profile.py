"""Where a blended request's time goes, and what it costs against full prefill, in one vLLM engine.

``python -m lmcache_backend.bench.profiling.profile [--model NAME|PATH] [--sizes 1000,2000,4000]
[--repeats 3]`` (also ``lmcache-backend bench --profile``) starts one vLLM engine with the
CacheBlend connector (``time_phases: true``, prefix caching off) and, per prompt size:

1. stores the chunks of a RAG prompt with one question (a full prefill);
2. asks the prompt with the chunks reordered and a *new question every request*, rounds of
   full prefill (the request opts out, ``{"blend": false}``), naive reuse (ratio 0) and
   CacheBlend at each ``--ratios``, interleaved;
3. prints the medians of the time to first token (a one-token request, as a client sees it), each
   strategy's ratio to full prefill, the marginal cost of a recomputed token-layer, and the blend
   path's phases (from the worker's timers) for the first CacheBlend ratio; with several sizes,
   the stage profile: each phase's (and each strategy's) fixed cost and cost per 1,000 tokens
   (:mod:`~lmcache_backend.bench.profiling.stage_profile`);
4. with ``--ops N``, runs one more such request under ``torch.profiler`` and prints its ``N``
   costliest operators by input shape (the engine then runs in this process, so the profiler
   sees the worker: the blend, vLLM's forward of the question and sampling).

It also reports each strategy's peak memory: the engine process's peak resident set while the
request ran (Linux ``VmHWM``, reset before each request), median over the rounds, and the
resident set before the size's first request.

Every number comes from the same engine, so full prefill and CacheBlend run on the same cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

from lmcache_backend.bench.datasets.sized import sized_prompts
from lmcache_backend.bench.profiling.stage_profile import describe
from lmcache_backend.blend.segmenting import PROMPT_SHAPES
from lmcache_backend.settings.arguments import setting_type
from lmcache_backend.settings.writer import STARTED_ENGINE, export

#: the blend path's phases, in the order they run (``BlendRecord.phases_ms`` keys)
PHASES = (
    ("prefix read", "read of vLLM's prefix-cache hits"),
    ("lookup", "segment lookup (hashing, store index)"),
    ("load", "cached K/V of the hits, per layer"),
    ("rerotate", "cached keys re-rotated to their new positions"),
    ("preview: rest", "query_preview: the question over the cached K/V, all but attention"),
    ("preview: attention", "  ... its attention and the attention mass it gives each token"),
    ("preview: engine forward", "  ... or, instead of its rest, it through vLLM's forward pass"),
    ("full: rest", "every token (before the first check layer, or a fallback): all but attention"),
    ("full: attention", "  ... their attention"),
    ("check: rest", "check layers: all but attention"),
    ("check: attention", "  ... their attention"),
    ("select and blend", "deviation, top-k, scatter of fresh rows"),
    ("selected: rest", "the selected tokens' layers (after a check or a preview): not attention"),
    ("selected: attention", "  ... their attention"),
    ("selected: engine forward", "the selected tokens through vLLM's forward pass, all layers"),
    ("write-back", "blended K/V into vLLM's paged cache"),
    ("logits", "last token's logits"),
    ("vllm step", "vLLM's own forward pass of the question, sampling"),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        metavar="PATH|NAME",
        default=None,
        help="model folder or embedded model (smollm2, gemma3-270m; default: smollm2)",
    )
    parser.add_argument("--sizes", default="1000,2000,4000", help="prompt sizes in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per size")
    parser.add_argument(
        "--ratios",
        type=setting_type("blend_recompute_ratios"),
        default=[0.15, 0.3],
        help="CacheBlend ratios (the first one is profiled)",
    )
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument(
        "--layerwise",
        action="store_true",
        help="the preview and the selected tokens through the blender's layer-by-layer path "
        "(connector key engine_forward=false) instead of vLLM's forward pass",
    )
    parser.add_argument(
        "--shape",
        choices=PROMPT_SHAPES,
        default=None,
        help="prompt shape: chunks after blend_special_str in a chat (separator), LangChain's "
        "stock RAG prompt (chunks joined by blank lines in the system message, no separator) "
        "or completions text (text); default: the model's",
    )
    parser.add_argument(
        "--layers-per-step",
        default="auto",
        help="the connector's blend_layers_per_step: 0 (at once), n (every blend sliced, n "
        "layer passes a step) or auto (the default: blends longer than one vLLM step sliced)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--ops", type=int, default=0, metavar="N", help="also print the N costliest operators"
    )
    args = parser.parse_args(argv)
    if args.ops:  # the worker in this process, where the profiler can see it
        export(vllm_enable_v1_multiprocessing=False)
    sizes = [int(s) for s in args.sizes.split(",")]
    ratios = args.ratios
    export(defaults=STARTED_ENGINE)

    from transformers import AutoConfig, AutoTokenizer

    from lmcache_backend.bench.datasets.devset import prompt_shape_for
    from lmcache_backend.config import load_config
    from lmcache_backend.data.embedded import resolve_model
    from lmcache_backend.integration.vllm.offline import generate_one, offline_engine, read_records

    path = resolve_model(args.model)
    shape = args.shape or prompt_shape_for(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    layers = int(AutoConfig.from_pretrained(path).num_hidden_layers)
    separator = load_config().blend_special_str
    prompts = {size: sized_prompts(tok, size, args.repeats + 1, separator, shape) for size in sizes}
    longest = max(len(p) for warm, asked in prompts.values() for p in [warm, *asked])
    stats = os.path.join(tempfile.mkdtemp(prefix="lmcache-profile-"), "stats.jsonl")
    llm = offline_engine(
        path,
        stats_file=stats,
        extra_config={
            "time_phases": True,
            "engine_forward": not args.layerwise,
            "blend_layers_per_step": args.layers_per_step,
        },
        enforce_eager=args.eager,
        max_model_len=max(8192, longest + 8),  # the longest prompt and its one output token
    )
    memory = PeakMemory()

    def ask(ids, params):
        before = len(read_records(stats))
        memory.reset()
        start = time.perf_counter()
        generate_one(llm, ids, 1, params)
        ttft = time.perf_counter() - start
        new = read_records(stats)[before:]
        return ttft, (new[-1] if new else None)

    modes = [("full prefill", {"blend": False}), ("naive reuse", {"blend_recompute_ratios": [0.0]})]
    modes += [(f"CacheBlend {r:g}", {"blend_recompute_ratios": [r]}) for r in ratios]
    profiled = f"CacheBlend {ratios[0]:g}"
    med = statistics.median
    results = []
    for size in sizes:
        warm, asked = prompts[size]
        resident = memory.resident_mib()
        ask(warm, {"blend": False})  # computes and stores the chunks
        times: dict[str, list[float]] = {name: [] for name, _ in modes}
        peaks: dict[str, list[float]] = {name: [] for name, _ in modes}
        token_layers: dict[str, list[float]] = {name: [] for name, _ in modes}
        phases: list[dict] = []
        attention: list[float] = []  # the profiled ratio's share of full prefill's attention
        for i, ids in enumerate(asked):  # round 0 warms this shape up, untimed
            for name, params in modes:
                ttft, rec = ask(ids, params)
                if i == 0:
                    continue
                times[name].append(ttft)
                peaks[name].append(memory.peak_mib())
                fraction = rec["token_layer_fraction"] if rec else 1.0
                token_layers[name].append(fraction * len(ids) * layers)
                if name == profiled and rec and rec.get("phases_ms"):
                    phases.append(rec["phases_ms"])
                    attention.append(rec.get("attention_fraction", 1.0))
        n = len(asked[0])
        full = med(times["full prefill"])
        row = {
            "prompt_tokens": n,
            "load_average": os.getloadavg(),
            "ttft_ms": {k: round(1000 * med(v), 1) for k, v in times.items()},
            "ratio_to_full": {k: round(med(v) / full, 3) for k, v in times.items()},
            "token_layer_fraction": {
                k: round(med(v) / (n * layers), 3) for k, v in token_layers.items()
            },
            "full_us_per_token_layer": round(1e6 * full / (n * layers), 2),
        }
        if resident is not None:
            row["resident_mib_before"] = round(resident)
            row["peak_mib"] = {k: round(med(v)) for k, v in peaks.items()}
        if len(ratios) > 1:
            lo, hi = f"CacheBlend {ratios[0]:g}", f"CacheBlend {ratios[-1]:g}"
            extra = med(token_layers[hi]) - med(token_layers[lo])
            if extra > 0:
                row["marginal_us_per_token_layer"] = round(
                    1e6 * (med(times[hi]) - med(times[lo])) / extra, 2
                )
        if attention:
            row["attention_fraction"] = round(med(attention), 3)
        if phases:
            keys = {k for p in phases for k in p}
            row["phases_ms"] = {k: round(med(p.get(k, 0.0) for p in phases), 2) for k in keys}
        if args.ops:
            request = functools.partial(ask, asked[-1], dict(modes)[profiled])
            row["ops"] = _operators(request, args.ops)
        results.append(row)
        _print(row, profiled)
    if len(results) > 1:
        stages = stage_profile_of(results)
        print(f"\n== stage profile ({profiled}'s phases; every strategy's TTFT)")
        known = [name for name, _ in PHASES]
        for text in describe(stages, order=[name for name, _ in modes] + known):
            print(f"  {text}")
        results.append({"stage_profile": stages})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    llm.llm_engine.engine_core.shutdown()


def stage_profile_of(rows: list[dict]) -> dict:
    """Each strategy's TTFT and each profiled phase split into fixed and per-1k-token cost,
    from the sizes' medians."""
    from lmcache_backend.bench.profiling.stage_profile import stage_profile

    return stage_profile(
        {row["prompt_tokens"]: {**row["ttft_ms"], **row.get("phases_ms", {})} for row in rows}
    )


class PeakMemory:
    """The engine process's peak resident set (Linux ``/proc``): the largest of this process and
    its children (vLLM's engine core runs in a child unless multiprocessing is off). Elsewhere
    every figure is None."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()

    def _pids(self) -> list[int]:
        return [self._me.pid] + [c.pid for c in self._me.children(recursive=True)]

    @staticmethod
    def _status(pid: int, field: str) -> float | None:
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) / 1024.0  # kB -> MiB
        except OSError:
            return None
        return None

    def _largest(self, field: str) -> float | None:
        values = [v for v in (self._status(p, field) for p in self._pids()) if v is not None]
        return max(values) if values else None

    def reset(self) -> None:
        """Start a new peak: ``5`` in ``clear_refs`` sets ``VmHWM`` to the current RSS."""
        for pid in self._pids():
            try:
                with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as fh:
                    fh.write("5")
            except OSError:
                pass

    def peak_mib(self) -> float | None:
        return self._largest("VmHWM")

    def resident_mib(self) -> float | None:
        return self._largest("VmRSS")


def _operators(request, top: int) -> list[dict]:
    """The ``top`` operators of one ``request()`` by self CPU time, per input shape."""
    import torch

    with torch.profiler.profile(record_shapes=True) as prof:
        request()
    events = sorted(
        prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total
    )
    return [
        {
            "op": e.key,
            "calls": e.count,
            "ms": round(e.self_cpu_time_total / 1000.0, 2),
            "shapes": str(e.input_shapes)[:100],
        }
        for e in events[:top]
    ]


def _print(row: dict, profiled: str) -> None:
    load = ", ".join(f"{x:.2f}" for x in row["load_average"])
    print(f"\n== {row['prompt_tokens']} prompt tokens (load average {load})")
    peaks = row.get("peak_mib", {})
    for name, ms in row["ttft_ms"].items():
        frac = row["token_layer_fraction"][name]
        ratio = row["ratio_to_full"][name]
        line = f"  {name:<16} TTFT {ms:8.1f} ms  {ratio:5.2f}x of full   token-layers {frac:.0%}"
        if peaks.get(name) is not None:
            line += f"   peak RSS {peaks[name]} MiB"
        print(line)
    if "resident_mib_before" in row:
        print(f"  resident before the size's first request: {row['resident_mib_before']} MiB")
    line = f"  full prefill: {row['full_us_per_token_layer']:.1f} us per token-layer"
    if "marginal_us_per_token_layer" in row:
        m = row["marginal_us_per_token_layer"]
        line += f"; marginal cost of a recomputed token-layer: {m:.1f} us"
        line += f" ({m / row['full_us_per_token_layer']:.2f}x)"
    print(line)
    if "attention_fraction" in row:
        print(
            f"  {profiled}: query-key pairs of its last layer {row['attention_fraction']:.0%} of "
            "full prefill's (attention costs by position)"
        )
    phases = row.get("phases_ms")
    if not phases:
        return
    print(f"  {profiled}, phases (median ms):")
    known = [name for name, _ in PHASES]
    for name, what in PHASES:
        if name in phases:
            print(f"    {name:<20} {phases[name]:8.2f}   {what}")
    for name in sorted(set(phases) - set(known)):
        print(f"    {name:<20} {phases[name]:8.2f}")
    blend = sum(v for k, v in phases.items() if k != "vllm step")
    print(f"    {'sum':<20} {blend + phases.get('vllm step', 0.0):8.2f}")
    if row.get("ops"):
        print(f"  {profiled}, costliest operators of one request (self CPU ms, calls, shapes):")
        for op in row["ops"]:
            print(f"    {op['ms']:9.2f} {op['calls']:5d}  {op['op']:<34} {op['shapes']}")


if __name__ == "__main__":
    main()
