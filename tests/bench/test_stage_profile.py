"""The stage profile: each stage's milliseconds at several prompt lengths split into a fixed cost
and a cost per 1,000 tokens."""

from __future__ import annotations

import pytest

from lmcache_backend.bench.profiling.stage_profile import describe, line, stage_profile


def test_two_lengths_give_the_line_through_them() -> None:
    assert line([(1000, 30.0), (4000, 90.0)]) == pytest.approx((10.0, 20.0))


def test_more_lengths_give_the_least_squares_line() -> None:
    fixed, per_1k = line([(1000, 31.0), (2000, 49.0), (4000, 91.0)])
    assert fixed == pytest.approx(10.0, abs=1.0) and per_1k == pytest.approx(20.0, abs=0.5)


def test_one_length_counts_every_millisecond_as_fixed() -> None:
    assert line([(1000, 42.0), (1000, 44.0)]) == (43.0, 0.0)
    assert line([]) == (0.0, 0.0)


def test_a_stage_missing_at_a_length_counts_zero_there() -> None:
    profile = stage_profile({1000: {"load": 5.0, "preview": 20.0}, 3000: {"preview": 40.0}})
    assert profile["preview"] == {"fixed_ms": 10.0, "per_1k_tokens_ms": 10.0}
    assert profile["load"] == {"fixed_ms": 7.5, "per_1k_tokens_ms": -2.5}
    lines = describe(profile, order=["preview"])
    assert lines[0].startswith("preview") and "10.00 ms fixed" in lines[0]


def test_the_served_profile_splits_each_strategy_and_phase() -> None:
    """``bench --profile`` over several sizes: every strategy's TTFT and every phase of the
    profiled ratio get a fixed and a per-1k-token cost."""
    from lmcache_backend.bench.profiling.profile import stage_profile_of

    rows = [
        {"prompt_tokens": 1000, "ttft_ms": {"full prefill": 300.0, "CacheBlend 0.2": 200.0},
         "phases_ms": {"preview: attention": 20.0}},
        {"prompt_tokens": 2000, "ttft_ms": {"full prefill": 700.0, "CacheBlend 0.2": 280.0},
         "phases_ms": {"preview: attention": 36.0}},
    ]  # fmt: skip
    profile = stage_profile_of(rows)
    assert profile["CacheBlend 0.2"] == {"fixed_ms": 120.0, "per_1k_tokens_ms": 80.0}
    assert profile["preview: attention"] == {"fixed_ms": 4.0, "per_1k_tokens_ms": 16.0}
    assert set(profile) == {"full prefill", "CacheBlend 0.2", "preview: attention"}
