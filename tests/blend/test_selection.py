"""Token selectors (``blend_selection``) on small tensors with hand-computed expectations, and
the query-aware selection inside the blender."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_hf import C1, C2, C3, Q1, Q2, SEP, SYS, rag_prompt, setup_blender, tiny_model, warm_store

from lmcache_backend.blend.selectors.selection import (
    NEEDS_QUERY_ATTENTION,
    PREVIEW_SELECTIONS,
    SCORERS,
    CheckInputs,
    chunk_heads,
    heads_first,
    position_discount,
    query_and_last_scores,
    query_attention_mass,
    span_ranked,
    value_norms,
)
from lmcache_backend.config import SELECTION_CHOICES, ConfigError, load_config
from lmcache_backend.integration.hf.engine import hf_full_prefill


def _inputs(query_attention=None) -> CheckInputs:
    # three tokens, one KV head of dim 2: key deviations 1, 4, 0; value deviations 0, 1, 1
    k_fresh = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]], [[3.0, 3.0]]])
    k_cached = torch.tensor([[[0.0, 0.0]], [[0.0, 0.0]], [[3.0, 3.0]]])
    v_fresh = torch.tensor([[[1.0, 1.0]], [[1.0, 0.0]], [[0.0, 1.0]]])
    v_cached = torch.tensor([[[1.0, 1.0]], [[0.0, 0.0]], [[0.0, 0.0]]])
    valid = torch.tensor([True, True, False])
    return CheckInputs(k_fresh, v_fresh, k_cached, v_cached, valid, query_attention)


def test_every_configurable_selection_has_a_scorer() -> None:
    assert set(SCORERS) | PREVIEW_SELECTIONS == set(SELECTION_CHOICES)
    assert NEEDS_QUERY_ATTENTION <= set(SELECTION_CHOICES)


def test_kv_deviation_scores_are_squared_key_distances() -> None:
    assert SCORERS["kv_deviation"](_inputs()).tolist() == [1.0, 4.0, 0.0]


def test_kv_deviation_v_adds_normalised_value_deviation() -> None:
    # keys: 1, 4, 0 over the valid mean 2.5; values: 0, 1, 1 over the valid mean 0.5
    expected = [1 / 2.5 + 0 / 0.5, 4 / 2.5 + 1 / 0.5, 0 / 2.5 + 1 / 0.5]
    scores = SCORERS["kv_deviation_v"](_inputs())
    torch.testing.assert_close(scores, torch.tensor(expected))


def test_query_attention_scores_pass_the_mass_through() -> None:
    mass = torch.tensor([0.5, 0.25, 2.0])
    assert SCORERS["query_attention"](_inputs(mass)).tolist() == [0.5, 0.25, 2.0]
    with pytest.raises(ValueError, match="query's attention"):
        SCORERS["query_attention"](_inputs())


def test_query_kv_deviation_multiplies_mass_and_key_distance() -> None:
    mass = torch.tensor([0.5, 0.25, 2.0])
    scores = SCORERS["query_kv_deviation"](_inputs(mass))
    torch.testing.assert_close(scores, torch.tensor([0.5 * 1.0, 0.25 * 2.0, 0.0]))


def test_value_weighting_multiplies_mass_by_mean_value_norm() -> None:
    mass = torch.tensor([1.0, 2.0])
    values = torch.tensor([[[3.0, 4.0], [0.0, 1.0]], [[0.0, 0.0], [6.0, 8.0]]])  # norms 5,1 / 0,10
    torch.testing.assert_close(mass * value_norms(values), torch.tensor([3.0, 10.0]))


def test_query_attention_mass_by_hand() -> None:
    # one query at position 1 over keys at 0, 1, 2: it sees keys 0 and 1 only
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]], [[5.0, 5.0]]])
    mass = query_attention_mass(q, k, torch.tensor([1]), scale=1.0)
    e = math.e
    torch.testing.assert_close(mass, torch.tensor([e / (e + 1), 1 / (e + 1), 0.0]))


def test_query_attention_mass_sums_heads_and_queries_with_gqa() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(3, 4, 8), torch.randn(10, 2, 8)  # 4 query heads share 2 KV heads
    positions = torch.tensor([7, 8, 9])
    mass = query_attention_mass(q, k, positions, scale=8**-0.5)
    expected = torch.zeros(10)
    for i, p in enumerate(positions.tolist()):
        for h in range(4):
            logits = (k[: p + 1, h // 2] @ q[i, h]) * 8**-0.5
            expected[: p + 1] += torch.softmax(logits, -1)
    torch.testing.assert_close(mass, expected)
    assert float(mass.sum()) == pytest.approx(3 * 4)


def test_unknown_selection_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="blend_selection.*'bogus'.*kv_deviation"):
        load_config(env={"LMCACHE_BLEND_SELECTION": "bogus"})


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_query_attention_selection_keeps_what_the_question_reads(llama) -> None:
    """The check layer (1) keeps the reusable tokens that the query tokens attend to most in a
    full prefill, summed over layers 0 and 1, plus every token of the query."""
    blender, cache = setup_blender(llama, ratios=(0.2,), selection="query_attention")
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    query_start = len(tokens) - len(Q2)
    assert blender.start_request(tokens).query_start == query_start
    result = blender.blend(tokens)

    full = hf_full_prefill(llama, tokens)
    adapter = blender.model
    with torch.no_grad():
        hidden = llama(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    positions = torch.arange(len(tokens))
    mass = torch.zeros(len(tokens))
    for layer in (0, 1):
        q, _, _ = adapter.qkv(layer, adapter.attention_input(layer, hidden[layer][0]), positions)
        mass += query_attention_mass(
            q[query_start:], full.keys[layer], positions[query_start:], adapter.attn_scale
        )
    valid = result.valid_mask
    count = int(0.2 * int(valid.sum()))
    candidates = valid.clone()
    candidates[: len(SYS) + len(SEP)] = False  # the system part is exact: never recomputed
    top = torch.topk(mass.masked_fill(~candidates, -1.0), count).indices.tolist()
    assert result.recomputed.tolist() == sorted(top + list(range(query_start, len(tokens))))


def test_query_preview_recomputes_what_the_preview_attends_to(llama, monkeypatch) -> None:
    """The preview's attention mass decides the fixed selection: with a mass that favours known
    tokens, exactly those (plus the query) are recomputed in every layer."""
    import lmcache_backend.blend.selectors.preview_mass as preview_mass

    blender, cache = setup_blender(llama, ratios=(0.1,), selection="query_preview")
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    query_start = len(tokens) - len(Q2)
    # the system part (tokens 0..13, stored at position 0) is exact: favouring it changes nothing
    system = list(range(len(SYS) + len(SEP)))
    favoured = [17, 40, 41, 77, 90, 101, 110, 120, 130, 140, 141, 142, 143, 20, 25, 30]
    count = int(0.1 * query_start)

    real = preview_mass.attention_with_query_mass

    def fake_mass(q, k, v, positions, scale, rows, **kw):
        out, _, last = real(q, k, v, positions, scale, rows, **kw)
        # ranks 100x apart: the value-norm weighting cannot reorder them
        mass = torch.zeros(k.shape[0])
        mass[system] = 1e36
        mass[favoured] = 100.0 ** torch.arange(len(favoured), 0, -1, dtype=torch.float32)
        return out, mass, last

    monkeypatch.setattr(preview_mass, "attention_with_query_mass", fake_mass)
    result = blender.blend(tokens)
    query = list(range(query_start, len(tokens)))
    assert result.recomputed.tolist() == sorted(favoured[:count]) + query
    layers = blender.model.num_layers
    # the preview (query tokens) and the blend (selection + query), every layer
    assert result.token_layers == layers * (len(query) + count + len(query))


def test_query_preview_is_closer_to_full_prefill_than_naive_reuse(llama) -> None:
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    full = hf_full_prefill(llama, tokens).logits
    errors = {}
    for selection, ratio in (("query_preview", 0.3), ("kv_deviation", 0.0)):
        blender, cache = setup_blender(llama, ratios=(ratio,), selection=selection)
        warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
        errors[selection] = float((blender.blend(tokens).logits - full).abs().max())
    assert errors["query_preview"] < errors["kv_deviation"]


@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("query_rows", [[4, 5, 6], [5, 6, 7]], ids=["middle", "tail"])
@pytest.mark.parametrize("window", [None, 6], ids=["causal", "window6"])
def test_attention_with_query_mass_matches_the_separate_ops(heads, query_rows, window) -> None:
    """The preview's fused op: the same output as the exact-mask attention reference and the
    same mass as query_attention_mass of the query rows (fp32 math, tolerance 1e-5), whether the
    query rows are the last rows (the preview's case) or not, with or without a sliding
    window."""
    from lmcache_backend.blend.selectors.selection import (
        attention_with_query_mass,
        query_attention_mass,
    )
    from lmcache_backend.ops.reference import attention_at_positions

    g = torch.Generator().manual_seed(3)
    hq, hkv = heads
    t = 40
    positions = torch.tensor([3, 7, 8, 20, 33, 37, 38, 39])
    q = torch.randn(len(positions), hq, 16, generator=g)
    k = torch.randn(t, hkv, 16, generator=g)
    v = torch.randn(t, hkv, 16, generator=g)
    rows = torch.tensor(query_rows)
    out, mass, last = attention_with_query_mass(q, k, v, positions, 0.25, rows, window)
    kw = {} if window is None else {"window": window}
    torch.testing.assert_close(out, attention_at_positions(q, k, v, positions, 0.25, **kw))
    expected = query_attention_mass(q[rows], k, positions[rows], 0.25, window)
    torch.testing.assert_close(mass, expected)
    last_alone = query_attention_mass(q[-1:], k, positions[-1:], 0.25, window)
    torch.testing.assert_close(last, last_alone)
    if query_rows == [4, 5, 6]:
        assert float(mass[39]) == 0.0  # after every query row's position (33, 37, 38)
    if window is not None:  # before every query row's window (33 - 6 + 1 = 28 the first seen)
        first = int(positions[rows[0]]) - window + 1
        assert float(mass[:first].abs().sum()) == 0.0 and float(mass[first]) > 0
        assert float(last[: 39 - window + 1].abs().sum()) == 0.0
    # every query row and head contributes one distribution
    assert abs(float(mass.sum()) - len(rows) * hq) < 1e-4


def test_attention_with_query_mass_hides_keys_no_pass_computed() -> None:
    """Hidden keys (uncached tokens the preview leaves to the blend) are read by no query: the
    output and masses equal those over the other keys alone, even when the hidden rows hold
    non-finite values (fp32, tolerance 1e-5)."""
    from lmcache_backend.blend.selectors.selection import attention_with_query_mass

    g = torch.Generator().manual_seed(5)
    t = 32
    positions = torch.tensor([28, 29, 30, 31])
    q = torch.randn(4, 6, 16, generator=g)
    k = torch.randn(t, 2, 16, generator=g)
    v = torch.randn(t, 2, 16, generator=g)
    hidden = torch.zeros(t, dtype=torch.bool)
    hidden[10:14] = True
    k[hidden], v[hidden] = float("nan"), float("inf")
    rows = torch.tensor([2, 3])
    out, mass, last = attention_with_query_mass(q, k, v, positions, 0.25, rows, hidden=hidden)
    keep = torch.nonzero(~hidden).flatten()
    # the same keys without the hidden rows: positions shift, so compare with a mask-free pass
    # (every query sees every kept key: all kept keys precede position 28 or are the queries')
    ref_k, ref_v = k[keep], v[keep]
    ref_positions = positions - int(hidden.sum())
    ref_out, ref_mass, ref_last = attention_with_query_mass(
        q, ref_k, ref_v, ref_positions, 0.25, rows
    )
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(mass[keep], ref_mass)
    torch.testing.assert_close(last[keep], ref_last)
    assert float(mass[hidden].abs().sum()) == 0.0 and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_with_query_mass_in_half_precision(dtype) -> None:
    """bf16/fp16 keys: the products run in that dtype, softmax and masses in fp32. Against the
    fp32 op on the same (rounded) inputs: output within 2e-2, masses within 2% of the total."""
    from lmcache_backend.blend.selectors.selection import attention_with_query_mass

    g = torch.Generator().manual_seed(5)
    t, positions = 300, torch.tensor([10, 11, 150, 296, 297, 298, 299])
    q, k, v = (torch.randn(n, h, 64, generator=g).to(dtype) for n, h in ((7, 9), (t, 3), (t, 3)))
    rows = torch.tensor([3, 4, 5, 6])
    out, mass, last = attention_with_query_mass(q, k, v, positions, 0.125, rows)
    ref_out, ref_mass, ref_last = attention_with_query_mass(
        q.float(), k.float(), v.float(), positions, 0.125, rows
    )
    assert out.dtype == dtype and mass.dtype == last.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=0)
    assert float((mass - ref_mass).abs().sum()) < 0.02 * float(ref_mass.sum())
    assert float((last - ref_last).abs().sum()) < 0.02 * float(ref_last.sum())


def test_query_and_last_scores_add_each_mass_as_a_share_of_its_candidates_total() -> None:
    query = torch.tensor([1.0, 3.0, 0.0, 4.0])
    last = torch.tensor([0.0, 1.0, 1.0, 100.0])
    candidates = torch.tensor([True, True, True, False])  # token 3 cannot be chosen
    scores = query_and_last_scores(query, last, candidates)
    torch.testing.assert_close(scores, query / 4 + last / 2)
    assert int(scores[:3].argmax()) == 1  # read by both


def test_position_discount_divides_by_one_plus_d_times_the_relative_position() -> None:
    positions = torch.tensor([0, 1, 4, 9])  # a prompt of 10 positions
    torch.testing.assert_close(
        position_discount(positions, 10.0), torch.tensor([2.0, 3.0, 6.0, 11.0])
    )
    torch.testing.assert_close(position_discount(positions, 0.0), torch.ones(4))


@pytest.mark.parametrize("selection", sorted(PREVIEW_SELECTIONS))
def test_position_discount_prefers_the_earlier_of_two_close_scores(llama, monkeypatch, selection):
    """Token 30 scores a little below token 120: without the discount token 120 is chosen, with
    it token 30 (120 / 30 positions apart, scores 10% apart). Scores far apart keep their order."""
    import lmcache_backend.blend.selectors.preview_mass as preview_mass

    real = preview_mass.attention_with_query_mass

    def fake(q, k, v, positions, scale, rows, **kw):
        out, _, _ = real(q, k, v, positions, scale, rows, **kw)
        mass = torch.zeros(k.shape[0])
        mass[[30, 120, 140]] = torch.tensor([0.9, 1.0, 100.0])  # 140: far above both
        return out, mass, mass.clone()

    monkeypatch.setattr(preview_mass, "attention_with_query_mass", fake)
    monkeypatch.setattr(preview_mass, "value_norms", lambda values: torch.ones(values.shape[0]))
    # every reused token equally stale: the staleness-aware selection then ranks by reads alone
    import lmcache_backend.blend.selectors.preview as preview

    monkeypatch.setattr(
        preview, "token_staleness", lambda meta, device: torch.ones(meta.positions.numel())
    )
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    chosen = {}
    for discount in (0.0, 10.0):
        blender, cache = setup_blender(
            llama, (0.02,), selection=selection, position_discount=discount
        )
        warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
        chosen[discount] = set(blender.blend(tokens).recomputed.tolist()) & {30, 120, 140}
    assert chosen[0.0] == {120, 140}
    assert chosen[10.0] == {30, 140}


def test_chunk_heads_marks_the_first_tokens_of_each_chunk() -> None:
    heads = chunk_heads([(2, 5), (7, 1), (8, 4)], 11, 2)
    assert torch.nonzero(heads).flatten().tolist() == [2, 3, 7, 8, 9]
    assert not chunk_heads([(0, 3)], 3, 0).any()


def test_heads_first_ranks_heads_above_any_score_keeping_their_order() -> None:
    scores = torch.tensor([5.0, -2.0, 0.5, 100.0, 0.25])
    heads = torch.tensor([False, True, True, False, True])
    ranked = heads_first(scores, heads)
    assert torch.topk(ranked, 3).indices.tolist() == [2, 4, 1]
    assert ranked[3] > ranked[0]  # the others keep their order below


def test_chunk_head_tokens_are_recomputed_first(llama, monkeypatch) -> None:
    """``blend_chunk_head_tokens=2``: the first two tokens of every reused chunk (not the exact
    system prefix) are recomputed, and the preview's best tokens fill the rest of the same
    budget."""
    import lmcache_backend.blend.selectors.preview_mass as preview_mass

    real = preview_mass.attention_with_query_mass
    favoured = [17, 40, 41, 77, 90, 101, 110, 120, 130, 140, 141, 142, 143, 20, 25, 30]

    def fake_mass(q, k, v, positions, scale, rows, **kw):
        out, _, last = real(q, k, v, positions, scale, rows, **kw)
        mass = torch.zeros(k.shape[0])
        mass[favoured] = 100.0 ** torch.arange(len(favoured), 0, -1, dtype=torch.float32)
        return out, mass, last

    monkeypatch.setattr(preview_mass, "attention_with_query_mass", fake_mass)
    blender, cache = setup_blender(llama, ratios=(0.1,), selection="query_preview")
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    query_start = len(tokens) - len(Q2)
    count = int(0.1 * query_start)
    starts = [len(SYS) + len(SEP)]
    for chunk in (C3, C1):
        starts.append(starts[-1] + len(chunk) + len(SEP))
    heads = {s + i for s in starts for i in range(2)}
    rest = [t for t in favoured if t not in heads][: count - len(heads)]
    config = blender.config.replace(blend_chunk_head_tokens=2)
    result = blender.blend(tokens, config=config)
    query = list(range(query_start, len(tokens)))
    assert result.recomputed.tolist() == sorted(heads | set(rest)) + query
    assert len(result.recomputed) == count + len(query)


def test_scored_layers_keep_the_layers_that_see_the_whole_prompt() -> None:
    from lmcache_backend.blend.selectors.selection import scored_layers

    gemma = [512] * 5 + [None] + [512] * 5 + [None]  # two of Gemma 3's six-layer groups
    assert scored_layers(gemma, 1000, 0, "global") == [w is None for w in gemma]
    assert scored_layers(gemma, 1000, 6, "global") == [i == 11 for i in range(12)]
    assert scored_layers(gemma, 1000, 0, "all") == [True] * 12
    assert scored_layers(gemma, 1000, 6, "all") == [i >= 6 for i in range(12)]
    assert scored_layers(gemma, 512, 0, "global") == [True] * 12  # the windows cover it
    mistral = [4096] * 4  # every layer windowed: all of them, whatever the prompt
    assert scored_layers(mistral, 8000, 1, "global") == [False, True, True, True]
    assert scored_layers([None] * 3, 8000, 0, "global") == [True] * 3


def test_preview_scores_only_the_layers_from_the_set_share(llama, monkeypatch) -> None:
    """``blend_preview_scored_from=0.5``: the reads of the first half of the layers do not count.
    Shallow layers read tokens 40 and 41 far more than deep layers read 90 and 100; scoring
    every layer recomputes the first pair, scoring the deep half the second."""
    import lmcache_backend.blend.selectors.preview_mass as preview_mass

    real = preview_mass.attention_with_query_mass
    calls = []

    def fake(q, k, v, positions, scale, rows, **kw):
        out, _, last = real(q, k, v, positions, scale, rows, **kw)
        mass = torch.zeros(k.shape[0])
        shallow = len(calls) % llama.config.num_hidden_layers < llama.config.num_hidden_layers // 2
        mass[[40, 41] if shallow else [90, 100]] = 100.0 if shallow else 1.0
        calls.append(shallow)
        return out, mass, last

    monkeypatch.setattr(preview_mass, "attention_with_query_mass", fake)
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    chosen = {}
    for share in (0.0, 0.5):
        blender, cache = setup_blender(llama, ratios=(0.02,), selection="query_preview")
        warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
        calls.clear()
        config = blender.config.replace(blend_preview_scored_from=share)
        result = blender.blend(tokens, config=config)
        chosen[share] = set(result.recomputed.tolist()) & {40, 41, 90, 100}
    assert chosen[0.0] == {40, 41}
    assert chosen[0.5] == {90, 100}


def test_query_preview_last_weights_the_last_tokens_reads(llama, monkeypatch) -> None:
    """A token only the last token reads outranks tokens the other query tokens read a little
    more: the last token's share counts as much as all the query tokens' together."""
    import lmcache_backend.blend.selectors.preview_mass as preview_mass

    real = preview_mass.attention_with_query_mass

    def fake(q, k, v, positions, scale, rows, **kw):
        out, _, _ = real(q, k, v, positions, scale, rows, **kw)
        mass, last = torch.zeros(k.shape[0]), torch.zeros(k.shape[0])
        mass[[40, 80, 100, 60]] = torch.tensor([3.0, 2.5, 2.4, 2.0])
        last[60] = 1.0  # only the last token reads token 60
        return out, mass, last

    monkeypatch.setattr(preview_mass, "attention_with_query_mass", fake)
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    chosen = {}
    for selection in ("query_preview", "query_preview_last"):
        blender, cache = setup_blender(llama, ratios=(0.02,), selection=selection)
        warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
        result = blender.blend(tokens)
        chosen[selection] = set(result.recomputed.tolist()) & {40, 60, 80, 100}
    assert 1 <= len(chosen["query_preview"]) <= 3
    assert 60 not in chosen["query_preview"] and 40 in chosen["query_preview"]
    assert 60 in chosen["query_preview_last"]


@pytest.mark.parametrize(
    "selection, ratio, expected, absent",
    [
        (
            "query_preview_last",
            0.3,
            {"preview: rest", "selected: rest", "selected: attention"},
            {"full: rest", "check: rest"},
        ),
        ("kv_deviation", 0.3, {"full: rest", "check: rest", "selected: rest"}, {"preview: rest"}),
    ],
)
def test_phase_timer_names_what_each_layer_computes(llama, selection, ratio, expected, absent):
    """The profile's phases: a preview's fixed selection is reported as the selected tokens'
    layers, not as layers of every token."""
    from lmcache_backend.blend.timing import PhaseTimer

    blender, cache = setup_blender(llama, ratios=(ratio,), selection=selection)
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    blender.timer = PhaseTimer()
    blender.blend(rag_prompt(SYS, C3, C1, C2, Q2))
    names = set(blender.timer.totals)
    assert expected <= names and not absent & names, sorted(names)


def test_span_ranked_takes_the_best_spans_whole_and_the_last_in_part() -> None:
    from lmcache_backend.ops.reference import select_topk_with_invalid

    # spans of 4: sums 1.0, 1.2, 0.05, 0.2; token 8 is not a candidate, so its 9.0 counts nowhere
    scores = torch.tensor(
        [0.1, 0.9, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3, 9.0, 0.0, 0.05, 0.0, 0.2, 0.0, 0.0, 0.0]
    )
    candidates = torch.ones(16, dtype=torch.bool)
    candidates[8] = False
    keys = span_ranked(scores, candidates, 4)
    # (the non-candidate 8 is listed as every uncached token is: always recomputed)
    assert select_topk_with_invalid(keys, candidates, 6).tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert select_topk_with_invalid(keys, candidates, 9).tolist() == [
        *range(9),
        12,
    ]
    # the span taken in part keeps its own best tokens, wherever they sit in it
    reversed_first = torch.cat([scores[:4].flip(0), scores[4:]])
    keys = span_ranked(reversed_first, candidates, 4)
    assert select_topk_with_invalid(keys, candidates, 6).tolist() == [2, 3, 4, 5, 6, 7, 8]
    # span 1 keeps the scores' own order
    distinct = torch.randperm(16, generator=torch.Generator().manual_seed(0)).float()
    single = span_ranked(distinct, candidates, 1)
    for count in (1, 2, 6, 15):
        assert torch.equal(
            select_topk_with_invalid(single, candidates, count),
            select_topk_with_invalid(distinct, candidates, count),
        )
    # a last span shorter than the others (18 tokens, spans of 4) is ranked like the rest
    tail = torch.cat([scores, torch.tensor([5.0, 0.0])])
    keys = span_ranked(tail, torch.cat([candidates, torch.ones(2, dtype=torch.bool)]), 4)
    assert int(keys.argmax()) == 16


@pytest.mark.parametrize("selection", sorted(PREVIEW_SELECTIONS))
def test_selection_span_recomputes_whole_aligned_spans(llama, selection) -> None:
    """With ``blend_selection_span=8`` the reusable tokens recomputed are whole aligned spans of
    8 but one (the last span taken may be cut to the count), as many as single-token selection
    recomputes, and not the same tokens."""
    recomputed = {}
    for span in (1, 8):
        blender, cache = setup_blender(llama, (0.2,), selection=selection, selection_span=span)
        warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
        result = blender.blend(rag_prompt(SYS, C3, C1, C2, Q2))
        assert result.blended
        chosen = result.recomputed[result.valid_mask[result.recomputed]]
        recomputed[span] = chosen.tolist()
    assert len(recomputed[8]) == len(recomputed[1]) > 8
    per_span: dict[int, int] = {}
    for token in recomputed[8]:
        per_span[token // 8] = per_span.get(token // 8, 0) + 1
    valid = result.valid_mask
    partial = [s for s, n in per_span.items() if n < int(valid[s * 8 : s * 8 + 8].sum())]
    assert len(partial) <= 1, per_span
    assert recomputed[8] != recomputed[1]


def test_hidden_keys_in_the_prepared_masks_equal_masking_them_each_call() -> None:
    """The preview's masks built once with its hidden keys (finite rows: zero, or cached values
    a request's mask leaves out) give the output and masses of masking them in the call
    (fp32, tolerance 1e-6)."""
    from lmcache_backend.blend.selectors.selection import attention_with_query_mass, query_masks

    g = torch.Generator().manual_seed(9)
    t = 48
    positions = torch.tensor([30, 41, 45, 46, 47])
    q = torch.randn(5, 6, 16, generator=g)
    k = torch.randn(t, 2, 16, generator=g)
    v = torch.randn(t, 2, 16, generator=g)
    hidden = torch.zeros(t, dtype=torch.bool)
    hidden[[3, 12, 13, 14, 40]] = True
    k[12:15], v[12:15] = 0.0, 0.0  # uncached rows are zero; rows 3 and 40 keep values
    rows = torch.tensor([2, 3, 4])
    for window in (None, 9):
        want = attention_with_query_mass(q, k, v, positions, 0.25, rows, window, hidden=hidden)
        masks = query_masks(positions, t, rows, window, hidden)
        got = attention_with_query_mass(q, k, v, positions, 0.25, rows, window, masks=masks)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert float(got[1][hidden].abs().sum()) == 0.0
