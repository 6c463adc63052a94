"""The benchmark's fidelity-knob strategies and the deviation oracle (a bound on selection
rules): how they are built from the flags, and which tokens the oracle picks."""

from __future__ import annotations

import pytest
import torch

from lmcache_backend.bench.quality.engines import oracle_recompute_mask
from lmcache_backend.bench.quality.strategies import BLEND, ORACLE, build_strategies


def test_read_shares_add_a_knob_strategy_per_blend_ratio() -> None:
    built = build_strategies(
        ratios=[0.2, 0.5], epic_k=0, include_prefix=False, read_shares=[0.6], oracle_ratios=[0.2]
    )
    names = [s.name for s in built]
    assert names == [
        "full prefill",
        "naive reuse",
        "CacheBlend r=0.2",
        "CacheBlend r=0.2 read>=0.6",
        "CacheBlend r=0.5",
        "CacheBlend r=0.5 read>=0.6",
        "oracle r=0.2",
    ]
    knob = built[3]
    assert (knob.kind, knob.ratios, knob.read_share) == (BLEND, (0.2,), 0.6)
    assert built[2].read_share is None
    assert (built[-1].kind, built[-1].ratios) == (ORACLE, (0.2,))


def test_the_bench_refuses_a_read_share_of_one(capsys) -> None:
    import argparse

    from lmcache_backend.bench.arguments import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--read-shares", "0.5,0.8"]).read_shares == [0.5, 0.8]
    with pytest.raises(SystemExit):
        parser.parse_args(["--read-shares", "0.5,1.0"])
    err = capsys.readouterr().err
    assert "--read-shares: blend_min_read_share (from the command line) = '1.0'" in err
    assert "expected a number in [0, 1)" in err


def test_the_oracle_picks_the_reusable_tokens_that_deviate_most() -> None:
    # two layers, 5 tokens, one head of dim 2; token 4 is not reusable (the question)
    full_k = [torch.zeros(5, 1, 2), torch.zeros(5, 1, 2)]
    full_v = [torch.zeros(5, 1, 2), torch.zeros(5, 1, 2)]
    naive_k = [torch.zeros(5, 1, 2), torch.zeros(5, 1, 2)]
    naive_v = [torch.zeros(5, 1, 2), torch.zeros(5, 1, 2)]
    naive_k[0][1] = 1.0  # layer 0: token 1 deviates in K
    naive_v[1][3] = 10.0  # layer 1: token 3 deviates (a larger scale, normalised per layer)
    naive_v[1][2] = 5.0  # token 2 a bit less in the same layer
    naive_k[0][4] = 100.0  # the question deviates most but is not reusable
    valid = torch.tensor([True, True, True, True, False])
    pick = oracle_recompute_mask((full_k, full_v), (naive_k, naive_v), valid, 2)
    assert pick.tolist() == [False, True, False, True, False]
    assert not oracle_recompute_mask((full_k, full_v), (naive_k, naive_v), valid, 0).any()
