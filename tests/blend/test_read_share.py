"""The fidelity knob (``blend_min_read_share``): the count that reaches a share of the question's
reads, the share a selection holds, and the knob inside the blender's preview selection."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import C1, C2, C3, Q1, Q2, SYS, rag_prompt, setup_blender, tiny_model, warm_store

from lmcache_backend.blend.selectors.read_share import count_for_read_share, read_share
from lmcache_backend.config import ConfigError, load_config

READS = torch.tensor([0.0, 5.0, 3.0, 1.0, 1.0, 7.0])
#: token 0 is not choosable (the exact prefix), token 5 is not reusable (the question)
CANDIDATES = torch.tensor([False, True, True, True, True, False])


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize(
    ("share", "expected"),
    [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.95, 4), (0.0, 1)],
)
def test_the_count_is_the_fewest_best_tokens_holding_the_share(share, expected) -> None:
    # candidates' reads 5, 3, 1, 1 of 10: one token holds 50%, two 80%, three 90%
    assert count_for_read_share(READS, READS, CANDIDATES, share, 1, 4) == expected


def test_the_count_stays_between_the_ratio_and_the_cap() -> None:
    assert count_for_read_share(READS, READS, CANDIDATES, 0.95, 1, 2) == 2  # the cap
    assert count_for_read_share(READS, READS, CANDIDATES, 0.5, 3, 4) == 3  # the ratio's count
    assert count_for_read_share(READS, READS, CANDIDATES, 0.95, 3, 2) == 3  # cap below the ratio
    nothing = torch.zeros_like(READS)
    assert count_for_read_share(nothing, nothing, CANDIDATES, 0.9, 1, 4) == 1


def test_the_count_follows_the_selection_order_not_the_reads() -> None:
    # ranked (e.g. after the position discount) 3, 4, 2, 1: 1 + 1 + 3 = 50% after three tokens
    ranking = torch.tensor([9.0, 1.0, 2.0, 4.0, 3.0, 9.0])
    assert count_for_read_share(READS, ranking, CANDIDATES, 0.5, 1, 4) == 3
    assert count_for_read_share(READS, ranking, CANDIDATES, 0.51, 1, 4) == 4


def test_the_share_counts_candidates_only() -> None:
    chosen = torch.tensor([True, True, False, False, True, True])
    assert read_share(READS, chosen, CANDIDATES) == pytest.approx(0.6)
    assert read_share(torch.zeros(6), chosen, CANDIDATES) == 1.0


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"blend_min_read_share": 1.0}, "blend_min_read_share"),
        ({"blend_min_read_share": -0.1}, "blend_min_read_share"),
        ({"blend_min_read_share": "most"}, "blend_min_read_share"),
        ({"blend_max_recompute_ratio": 1.5}, "blend_max_recompute_ratio"),
        ({"blend_min_read_share": 0.9, "blend_selection": "kv_deviation"}, "blend_min_read_share"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(changes, key) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, **changes)
    message = str(caught.value)
    assert message.startswith(key) and "\n" not in message


def test_the_knob_raises_the_recompute_until_the_reads_are_held(llama) -> None:
    """On a tiny model with a spread preview, a 0.9 target recomputes more tokens than the ratio,
    the recomputed ones then hold at least 0.9 of the reads (or the cap binds), and the blend
    reports the share it reached; 0 (the default) leaves the ratio's selection unchanged."""
    blender, cache = setup_blender(llama, ratios=(0.05,), selection="query_preview_last")
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    plain = blender.blend(tokens)
    assert plain.read_share is not None and plain.read_share < 0.9
    again = blender.blend(tokens, config=blender.config.replace(blend_min_read_share=0.0))
    assert again.recomputed.tolist() == plain.recomputed.tolist()

    knob = blender.config.replace(blend_min_read_share=0.9, blend_max_recompute_ratio=1.0)
    raised = blender.blend(tokens, config=knob)
    assert raised.recomputed_reusable > plain.recomputed_reusable
    assert raised.read_share >= 0.9
    assert set(plain.recomputed.tolist()) <= set(raised.recomputed.tolist())

    capped = blender.blend(tokens, config=knob.replace(blend_max_recompute_ratio=0.1))
    assert capped.recomputed_reusable <= int(0.1 * plain.num_reusable) + 1
    assert plain.read_share <= capped.read_share < 0.9
