"""A request's time split into what it costs whatever its length (fixed) and what grows with its
tokens (proportional), per stage, from the same request measured at several prompt lengths.

For every stage (a phase of the blend path's timers, or a whole request) the milliseconds at each
length are fitted with a line ``fixed + per_1k * tokens / 1000`` (least squares; two lengths give
it exactly). A fixed cost that is large against full prefill's time at short prompts is what
keeps a blend from paying there; a proportional cost above full prefill's is what keeps it from
paying at any length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(fixed, per_1k)`` of the least-squares line through ``(tokens, ms)`` points; with one
    length (or one point) every millisecond counts as fixed."""
    xs = [x / 1000.0 for x, _ in points]
    ys = [y for _, y in points]
    n = len(points)
    if n == 0:
        return 0.0, 0.0
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return mean_y - slope * mean_x, slope


def stage_profile(by_length: Mapping[int, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per stage, ``{"fixed_ms", "per_1k_tokens_ms"}`` from ``{tokens: {stage: ms}}`` (a stage
    missing at some length counts 0 ms there)."""
    stages = sorted({stage for stages in by_length.values() for stage in stages})
    out = {}
    for stage in stages:
        fixed, per_1k = line([(n, float(ms.get(stage, 0.0))) for n, ms in by_length.items()])
        out[stage] = {"fixed_ms": round(fixed, 2), "per_1k_tokens_ms": round(per_1k, 2)}
    return out


def describe(profile: Mapping[str, Mapping[str, float]], order: Sequence[str] = ()) -> list[str]:
    """One line per stage, ``order``'s first, then the rest by name."""
    names = [s for s in order if s in profile] + sorted(set(profile) - set(order))
    width = max((len(n) for n in names), default=0)
    return [
        f"{name:<{width}}  {profile[name]['fixed_ms']:9.2f} ms fixed  "
        f"{profile[name]['per_1k_tokens_ms']:9.2f} ms per 1k tokens"
        for name in names
    ]
