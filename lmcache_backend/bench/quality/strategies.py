"""The strategies a benchmark compares, and the parsing of their command-line flags.

A strategy is data: its kind (``full``, ``prefix``, ``blend``, ``epic``) and parameters. Engines
decide how to run each kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_backend.config import BlendConfig

FULL, PREFIX, BLEND, EPIC, ORACLE = "full", "prefix", "blend", "epic", "oracle"


@dataclass(frozen=True)
class Strategy:
    """One way to prefill a prompt.

    Attributes:
        name: the label in tables, JSON and plots.
        kind: ``full`` (no reuse), ``prefix`` (leading identical tokens only), ``blend``
            (CacheBlend; ratio 0 is naive full reuse), ``epic`` (static selection) or
            ``oracle`` (the tokens whose cached K/V deviate most from full prefill's, known from
            a full prefill: a bound for selection rules, not a way to serve).
        ratios: CacheBlend ratio per check layer (one value broadcasts), for ``blend``; the
            share recomputed, for ``oracle``.
        check_layers: CacheBlend check layers, for ``blend``.
        epic_k: leading tokens of each chunk recomputed, for ``epic``.
        block_size: prefix-cache granularity in tokens, for ``prefix`` (1 = any token).
        selection: CacheBlend token selector (``blend_selection``), for ``blend``; None: the
            engine's configured one.
        read_share: ``blend_min_read_share`` (the fidelity knob), for ``blend``; None: the
            engine's configured one.
        max_divergence: ``blend_max_divergence`` (the divergence knob), for ``blend``; None:
            the engine's configured one.
    """

    name: str
    kind: str
    ratios: tuple[float, ...] = ()
    check_layers: tuple[int, ...] = ()
    epic_k: int = 0
    block_size: int = 1
    selection: str | None = None
    read_share: float | None = None
    max_divergence: float | None = None

    @property
    def final_ratio(self) -> float | None:
        """The ratio that decides how many reusable tokens reach the last layer (blend only)."""
        return self.ratios[-1] if self.kind == BLEND and self.ratios else None


def parse_ints(text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]``; raises ValueError naming the bad item."""
    return [_number(item, int) for item in _items(text)]


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"empty item in {text!r}")
    return items


def _number(item: str, kind: type):
    try:
        return kind(item)
    except ValueError:
        raise ValueError(f"{item!r} is not a valid {kind.__name__}") from None


def parse_schedule(text: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``"1,2:0.3,0.15"`` -> check layers ``(1, 2)`` and ratios ``(0.3, 0.15)``, parsed and
    checked as the configuration's ``blend_check_layers`` and ``blend_recompute_ratios`` are
    (a :class:`~lmcache_backend.config.ConfigError`, a ``ValueError``, naming the key)."""
    if text.count(":") != 1:
        raise ValueError(f"expected LAYERS:RATIOS such as 1,2:0.3,0.15, got {text!r}")
    layers, ratios = text.split(":")
    config = BlendConfig(
        blend_check_layers=layers,
        blend_recompute_ratios=ratios,
        sources=dict.fromkeys(("blend_check_layers", "blend_recompute_ratios"), "--gradual"),
    )
    return tuple(config.blend_check_layers), tuple(config.blend_recompute_ratios)


def _fmt(values: Sequence[float | int]) -> str:
    return ",".join(f"{v:g}" for v in values)


def blend_strategy(
    ratios: Sequence[float],
    check_layers: Sequence[int],
    selection: str | None = None,
    read_share: float | None = None,
    max_divergence: float | None = None,
) -> Strategy:
    """CacheBlend with a schedule (and a selector, a read-share target and a divergence bound,
    when given); ratio 0 everywhere is naive full reuse."""
    ratios, layers = tuple(ratios), tuple(check_layers)
    if all(r == 0 for r in ratios):
        return Strategy("naive reuse", BLEND, ratios=(0.0,), check_layers=layers[:1])
    if len(ratios) == 1:
        name = f"CacheBlend r={ratios[0]:g}"
        if layers != (1,):
            name += f" L={_fmt(layers)}"
    else:
        name = f"CacheBlend r={_fmt(ratios)} L={_fmt(layers)}"
    if selection:
        name += f" {selection}"
    if read_share is not None:
        name += f" read>={read_share:g}"
    if max_divergence is not None:
        name += f" div<={max_divergence:g}"
    return Strategy(
        name,
        BLEND,
        ratios=ratios,
        check_layers=layers,
        selection=selection,
        read_share=read_share,
        max_divergence=max_divergence,
    )


def build_strategies(
    ratios: Sequence[float] = (0.05, 0.15, 0.3),
    check_layers: Sequence[int] = (1,),
    schedules: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
    epic_k: int = 16,
    prefix_block: int = 16,
    include_prefix: bool = True,
    include_naive: bool = True,
    selections: Sequence[str | None] = (None,),
    read_shares: Sequence[float] = (),
    oracle_ratios: Sequence[float] = (),
    max_divergences: Sequence[float] = (),
) -> list[Strategy]:
    """Full prefill first (every other strategy is compared with it), then prefix caching,
    naive reuse, one CacheBlend strategy per selector and ratio (the ratio applied at every check
    layer), per read-share target and per divergence bound on top of each ratio, one per selector
    and explicit
    schedule (gradual filtering), EPIC when ``epic_k`` > 0, and one deviation oracle per
    ``oracle_ratios`` entry. A selector of None is the engine's configured one."""
    out = [Strategy("full prefill", FULL)]
    if include_prefix:
        out.append(Strategy("prefix caching", PREFIX, block_size=max(1, prefix_block)))
    if include_naive:
        out.append(blend_strategy([0.0], check_layers))
    for selection in selections:
        for ratio in ratios:
            if ratio == 0 and include_naive:
                continue  # already there
            out.append(blend_strategy([ratio], check_layers, selection))
            if ratio > 0:
                out.extend(
                    blend_strategy([ratio], check_layers, selection, share) for share in read_shares
                )
                out.extend(
                    blend_strategy([ratio], check_layers, selection, max_divergence=bound)
                    for bound in max_divergences
                )
        for layers, schedule_ratios in schedules:
            out.append(blend_strategy(schedule_ratios, layers, selection))
    if epic_k > 0:
        out.append(Strategy(f"EPIC k={epic_k}", EPIC, epic_k=epic_k))
    out.extend(Strategy(f"oracle r={r:g}", ORACLE, ratios=(r,)) for r in oracle_ratios)
    names = [s.name for s in out]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ValueError(f"strategies given twice: {sorted(duplicates)}")
    return out
