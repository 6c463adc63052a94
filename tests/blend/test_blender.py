"""The blender on tiny random-weight Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 models (fp32).

Prompts are ``sys + SEP + c1 + SEP + c2 + SEP + c3 + SEP + question`` of random token ids; the
store is warmed with a full prefill of one order, then another order is blended.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_hf import (
    C1,
    C2,
    C3,
    Q1,
    Q2,
    SEP,
    SYS,
    collect_steps,
    rag_prompt,
    setup_blender,
    tiny_model,
    warm_store,
)

from lmcache_backend.blend import KVTarget, LMCBlender, LMCBlenderBuilder
from lmcache_backend.config import SELECTION_CHOICES
from lmcache_backend.integration.hf.engine import hf_full_prefill, kv_to_dynamic_cache
from lmcache_backend.models.base import window_kwargs


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def tiny(request):
    return request.param, tiny_model(request.param)


def _reordered_request(model, **setup) -> tuple[LMCBlender, list[int], int]:
    """A blender (``setup_blender``'s keywords) warmed with ``SYS C1 C2 C3 Q1``, the reordered
    prompt ``SYS C3 C1 C2 Q2`` and its ``compute_end`` (the start of the new question)."""
    blender, cache = setup_blender(model, **setup)
    warm_store(model, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    return blender, tokens, len(tokens) - len(Q2)


@pytest.mark.parametrize("selection", SELECTION_CHOICES)
def test_ratio_one_equals_full_prefill(tiny, selection) -> None:
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(1.0,), selection=selection)
    warm_store(model, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    reordered = rag_prompt(SYS, C3, C1, C2, Q2)
    result = blender.blend(reordered)
    assert result.blended and result.num_reusable == len(reordered) - len(Q2)
    full = hf_full_prefill(model, reordered)
    torch.testing.assert_close(result.logits, full.logits, rtol=0, atol=1e-3)
    for layer, (k, fk) in enumerate(zip(result.keys, full.keys)):
        torch.testing.assert_close(k, fk, rtol=0, atol=1e-4, msg=f"layer {layer} keys")


def test_ratio_zero_same_order_equals_prefix_reuse(tiny) -> None:
    """Chunks at their original positions, ratio 0: the question alone is computed over the
    cached prefix — exactly what prefix caching computes."""
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(0.0,))
    first = rag_prompt(SYS, C1, C2, Q1)
    warm_store(model, cache, first)
    second = rag_prompt(SYS, C1, C2, Q2)
    prefix_len = len(second) - len(Q2)
    result = blender.blend(second)
    assert result.recomputed.tolist() == list(range(prefix_len, len(second)))
    warm = hf_full_prefill(model, first)
    cache_kv = kv_to_dynamic_cache(
        model, [k[:prefix_len] for k in warm.keys], [v[:prefix_len] for v in warm.values]
    )
    with torch.no_grad():
        out = model(input_ids=torch.tensor([Q2]), past_key_values=cache_kv, use_cache=True)
    torch.testing.assert_close(result.logits, out.logits[0, -1].float(), rtol=0, atol=1e-4)


def test_reordered_naive_reuse_rerotates(tiny) -> None:
    """Ratio 0 on a reordered prompt: layer-0 keys are recomputed, the rest are the cached keys
    re-rotated to the new positions (compare with the keys cached at those tokens)."""
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(0.0,))
    first = rag_prompt(SYS, C1, C2, Q1)
    warm_store(model, cache, first)
    second = rag_prompt(SYS, C2, C1, Q1)
    result = blender.blend(second)
    warm = hf_full_prefill(model, first)
    adapter = blender.model
    c1_old = len(SYS) + len(SEP)
    c1_new = c1_old + len(C2) + len(SEP)
    n = len(C1) + len(SEP)
    from lmcache_backend.ops.reference import rope_rerotate_k

    layer = 2
    expected = rope_rerotate_k(
        warm.keys[layer][c1_old : c1_old + n].clone(),
        torch.arange(c1_old, c1_old + n),
        torch.arange(c1_new, c1_new + n),
        adapter.rotation_table(layer),
        adapter.is_neox,
    )
    torch.testing.assert_close(result.keys[layer][c1_new : c1_new + n], expected)
    torch.testing.assert_close(
        result.values[layer][c1_new : c1_new + n], warm.values[layer][c1_old : c1_old + n]
    )


def test_check_layer_counts_and_gradual_filtering(tiny) -> None:
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(0.5, 0.25), check_layers=(1, 2))
    warm_store(model, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    reordered = rag_prompt(SYS, C2, C3, C1, Q2)
    seen_layers, result = collect_steps(blender.blend_layer(reordered))
    assert seen_layers == list(range(model.config.num_hidden_layers))
    total = len(reordered)
    reusable = result.num_reusable
    invalid = total - reusable
    # layers 0 and 1 compute every token (layer 1 is where the first selection happens, after
    # q/k/v of all tokens); layer 1 keeps 50% of the reusable tokens, layer 2 then keeps 25% of
    # ALL reusable tokens (not 25% of the 50%), plus the uncached ones each time
    counts = [total, int(0.5 * reusable) + invalid] + [int(0.25 * reusable) + invalid] * (
        model.config.num_hidden_layers - 2
    )
    assert result.token_layers == sum(counts)
    assert result.recomputed.numel() == int(0.25 * reusable) + invalid
    assert result.recomputed[-1] == total - 1
    assert not result.valid_mask[-len(Q2) :].any()


def test_min_tokens_falls_back_to_full_prefill(tiny, caplog) -> None:
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(0.15,), min_tokens=10_000)
    warm_store(model, cache, rag_prompt(SYS, C1, Q1))
    tokens = rag_prompt(C1, SYS, Q1)
    with caplog.at_level(logging.INFO, logger="lmcache_backend.blend"):
        result = blender.blend(tokens)
    assert not result.blended and "blend_min_tokens=10000" in result.fallback_reason
    assert "falls back to a full prefill" in caplog.text
    assert result.token_layers == len(tokens) * model.config.num_hidden_layers
    torch.testing.assert_close(
        result.logits, hf_full_prefill(model, tokens).logits, atol=1e-3, rtol=0
    )


def test_check_layer_beyond_model_rejected(tiny) -> None:
    _, model = tiny
    from lmcache_backend.config import ConfigError

    with pytest.raises(ConfigError, match="blend_check_layers"):
        setup_blender(model, check_layers=(7,))


def test_mask_excludes_tokens_from_reuse(tiny) -> None:
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(0.0,))
    warm_store(model, cache, rag_prompt(SYS, C1, C2, Q1))
    tokens = rag_prompt(SYS, C2, C1, Q2)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[: len(SYS) + len(SEP)] = False
    result = blender.blend(tokens, mask=mask)
    assert not result.valid_mask[: len(SYS) + len(SEP)].any()
    assert result.num_reusable == len(C1) + len(C2) + 2 * len(SEP)


def test_builder_one_blender_per_instance(tiny) -> None:
    _, model = tiny
    blender, _ = setup_blender(model)
    a = LMCBlenderBuilder.get_or_create(
        "test-a", blender.cache_engine, None, blender.config, blender.model, SEP
    )
    b = LMCBlenderBuilder.get_or_create(
        "test-a", blender.cache_engine, None, blender.config, blender.model, SEP
    )
    c = LMCBlenderBuilder.get_or_create(
        "test-b", blender.cache_engine, None, blender.config, blender.model, SEP
    )
    assert a is b and a is not c and LMCBlenderBuilder.get("test-b") is c
    LMCBlenderBuilder.remove("test-a")
    LMCBlenderBuilder.remove("test-b")
    with pytest.raises(KeyError):
        LMCBlenderBuilder.get("test-a")


def test_gpu_connector_receives_every_layer(tiny) -> None:
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(0.3,))
    warm_store(model, cache, rag_prompt(SYS, C1, C2, Q1))
    written = {}

    class Writer:
        def write_layer(self, layer_id, keys, values):
            written[layer_id] = (keys.clone(), values.clone())

    blender.gpu_connector = Writer()
    result = blender.blend(rag_prompt(SYS, C2, C1, Q1))
    assert sorted(written) == list(range(model.config.num_hidden_layers))
    for layer, (k, v) in written.items():
        assert torch.equal(k, result.keys[layer]) and torch.equal(v, result.values[layer])


def test_cached_prefix_counts_as_reusable(tiny) -> None:
    """K/V the engine already holds for the first P tokens (no store entry at all) are reused
    as they are: ratio 0 then equals prefix reuse."""
    _, model = tiny
    blender, _ = setup_blender(model, ratios=(0.0,))
    first = rag_prompt(SYS, C1, C2, Q1)
    second = rag_prompt(SYS, C1, C2, Q2)
    prefix_len = len(second) - len(Q2)
    warm = hf_full_prefill(model, first)
    prefix = ([k[:prefix_len] for k in warm.keys], [v[:prefix_len] for v in warm.values])
    result = blender.blend(second, cached_prefix=prefix)
    assert result.num_reusable == prefix_len
    assert result.recomputed.tolist() == list(range(prefix_len, len(second)))
    cache_kv = kv_to_dynamic_cache(model, *prefix)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([Q2]), past_key_values=cache_kv, use_cache=True)
    torch.testing.assert_close(result.logits, out.logits[0, -1].float(), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="cached_prefix"):
        blender.blend(second, cached_prefix=(prefix[0][:1], prefix[1][:1]))


def test_static_recompute_selection(tiny) -> None:
    """A fixed selection (EPIC-style) replaces the check layers: the same tokens, plus the
    uncached ones and the last, are computed in every layer."""
    _, model = tiny
    blender, cache = setup_blender(model, ratios=(0.5,))
    warm_store(model, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    chosen = torch.zeros(len(tokens), dtype=torch.bool)
    chosen[[0, 20, 40]] = True
    result = blender.blend(tokens, recompute=chosen)
    expected = sorted({0, 20, 40} | set(range(len(tokens) - len(Q2), len(tokens))))
    assert result.recomputed.tolist() == expected
    assert result.token_layers == len(expected) * model.config.num_hidden_layers
    # everything else is the re-rotated cache: far from a full prefill, unlike ratio 1
    full = hf_full_prefill(model, tokens).logits
    assert (result.logits - full).abs().max() > 1e-4


def test_sliding_window_span() -> None:
    from types import SimpleNamespace

    from transformers import MistralConfig, Qwen2Config

    from lmcache_backend.models.base import sliding_window_span

    assert sliding_window_span(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window_span(MistralConfig(sliding_window=None)) is None
    assert sliding_window_span(Qwen2Config(sliding_window=1024, use_sliding_window=True)) == 1024
    # a config that keeps the window but switches it off (transformers clears it; others may not)
    kept = SimpleNamespace(sliding_window=1024, use_sliding_window=False)
    assert sliding_window_span(kept) is None


@pytest.mark.parametrize("selection", SELECTION_CHOICES)
@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_compute_end_leaves_the_tail_to_the_engine(tiny, selection, ratio) -> None:
    """With ``compute_end`` (the vLLM connector's question tail), the blend selects the same
    tokens, gives the same K/V for every token before it, computes no token after it once the
    selection is final, and returns no logits."""
    _, model = tiny
    blender, tokens, end = _reordered_request(model, ratios=(ratio,), selection=selection)
    whole = blender.blend(tokens)
    head = blender.blend(tokens, compute_end=end)
    assert head.logits is None and whole.logits is not None
    assert head.recomputed.tolist() == [i for i in whole.recomputed.tolist() if i < end]
    assert head.token_layers < whole.token_layers
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(head.keys[layer][:end], whole.keys[layer][:end])
        torch.testing.assert_close(head.values[layer][:end], whole.values[layer][:end])
    with pytest.raises(ValueError, match="compute_end"):
        blender.blend(tokens, compute_end=len(tokens) + 1)


@pytest.mark.parametrize("selection", ["query_preview_last", "kv_deviation"])
def test_last_layer_skips_what_nothing_reads(tiny, selection) -> None:
    """Without logits (``compute_end``), the last layer writes its K/V but runs no o_proj or
    MLP, in the blend or the preview; with logits the blend's last layer runs them once (the
    preview's never does)."""
    _, model = tiny
    layers = model.config.num_hidden_layers
    blender, tokens, end = _reordered_request(model, ratios=(0.3,), selection=selection)
    adapter = blender.model
    calls: list[tuple[str, int]] = []

    def recording(name):
        method = getattr(adapter, name)

        def record(layer, x):
            calls.append((name, layer))
            return method(layer, x)

        return record

    for name in ("attention_output", "mlp_block"):
        setattr(adapter, name, recording(name))
    head = blender.blend(tokens, compute_end=end)
    assert head.logits is None and head.keys[layers - 1].shape[0] == len(tokens)
    assert {layer for _, layer in calls} == set(range(layers - 1))
    calls.clear()
    whole = blender.blend(tokens)
    assert whole.logits is not None
    assert calls.count(("mlp_block", layers - 1)) == calls.count(("attention_output", layers - 1))
    assert calls.count(("mlp_block", layers - 1)) == 1


class _EngineKV(KVTarget):
    """A paged cache whose "engine" computes rows itself (``runs_engine_forward``): per-layer
    ``[T, Hkv, D]`` rows (NaN until written) and a forward pass of given tokens over them, made
    of the adapter's steps and the reference attention."""

    paged_attention = True
    runs_engine_forward = True

    def __init__(self, blender: LMCBlender, num_tokens: int) -> None:
        model = blender.model
        shape = (num_tokens, model.num_kv_heads, model.head_dim)
        self.model, self.ops = model, blender.ops
        self.keys = [torch.full(shape, float("nan")) for _ in range(model.num_layers)]
        self.values = [torch.full(shape, float("nan")) for _ in range(model.num_layers)]
        self.forwards: list[tuple[list[int], list[int], list[int]]] = []
        self.events: list[str] = []

    def write_layer(self, layer_id, keys, values):  # pragma: no cover - paged: rows only
        raise AssertionError("a paged writer receives rows")

    def write_rows(self, layer_id, rows, keys, values):
        self.events.append("rows")
        self.keys[layer_id][rows] = keys
        self.values[layer_id][rows] = values

    def attention(self, layer_id, q, positions, scale, keys=None, values=None, **window):
        self.events.append("attention")
        # the contiguous K/V handed over for a tiled kernel: the rows the queries may read
        end = int(positions.max()) + 1 if positions.numel() else 0
        assert keys is not None and torch.equal(keys[:end], self.keys[layer_id][:end])
        assert torch.equal(values[:end], self.values[layer_id][:end])
        keys, values = self.keys[layer_id], self.values[layer_id]
        return self.ops.attention_at_positions(q, keys, values, positions, scale, **window)

    def forward_rows(self, rows, token_ids, positions, kv=None):
        self.events.append("forward")
        # the blended K/V handed over for a tiled kernel: every layer as the cache holds it
        self.kv_as_written = kv is not None and all(
            torch.equal(kv[0][layer], self.keys[layer])
            and torch.equal(kv[1][layer], self.values[layer])
            for layer in range(self.model.num_layers)
        )
        self.forwards.append((rows.tolist(), token_ids.tolist(), positions.tolist()))
        model = self.model
        hidden = model.embed(token_ids)
        for layer in range(model.num_layers):
            q, k, v = model.qkv(layer, model.attention_input(layer, hidden), positions)
            self.keys[layer][rows], self.values[layer][rows] = k, v
            attn = self.ops.attention_at_positions(
                q,
                self.keys[layer],
                self.values[layer],
                positions,
                model.attn_scale,
                **window_kwargs(model, layer),
            )
            hidden = model.mlp_block(layer, hidden + model.attention_output(layer, attn))


@pytest.mark.parametrize("selection", ["query_preview_last", "query_preview"])
def test_engine_forward_gets_the_fixed_selection_over_every_cached_row(tiny, selection) -> None:
    """A fixed selection without logits, with a writer whose engine computes rows: every
    cached row of every layer is written first, then one engine pass of the selected tokens
    (their ids, positions) before ``compute_end``; the rows end up as the layer-by-layer blend's
    K/V, every layer is yielded, and the token-layers are counted."""
    _, model = tiny
    layers = model.config.num_hidden_layers
    blender, tokens, end = _reordered_request(model, ratios=(0.3,), selection=selection)
    reference = blender.blend(tokens, compute_end=end)
    engine = _EngineKV(blender, len(tokens))
    blender.gpu_connector = engine
    steps = blender.blend_layer(tokens, compute_end=end)
    yielded = []
    while True:
        try:
            yielded.append(next(steps))
        except StopIteration as done:
            result = done.value
            break
    assert yielded == list(range(layers))
    ((rows, ids, positions),) = engine.forwards
    assert engine.events == ["rows"] * layers + ["forward"]  # every cached row first
    assert engine.kv_as_written
    assert rows == reference.recomputed.tolist() and max(rows) < end
    assert ids == [tokens[i] for i in rows] and positions == rows
    assert result.recomputed.tolist() == rows and result.token_layers == reference.token_layers
    assert result.keys == [] and result.logits is None
    for layer in range(layers):
        torch.testing.assert_close(engine.keys[layer][:end], reference.keys[layer][:end])
        torch.testing.assert_close(engine.values[layer][:end], reference.values[layer][:end])
    # with logits (no compute_end) the blender computes the last token itself: no engine pass
    blender.gpu_connector = engine = _EngineKV(blender, len(tokens))
    whole = blender.blend(tokens)
    assert whole.logits is not None and "forward" not in engine.events
    assert "attention" in engine.events


class _PreviewEngine(KVTarget):
    """A writer whose "engine" runs a preview's tokens itself (``preview_rows``): the
    adapter's steps, each layer's attention by the blender's ``attend``. ``runs`` False: it
    declines (as vLLM's does for more tokens than one pass)."""

    def __init__(self, blender: LMCBlender, runs: bool = True) -> None:
        self.model, self.runs = blender.model, runs
        self.previews: list[tuple[list[int], list[int]]] = []

    def write_layer(self, layer_id, keys, values) -> None:
        pass

    def preview_rows(self, token_ids, positions, attend) -> bool:
        self.previews.append((token_ids.tolist(), positions.tolist()))
        if not self.runs:
            return False
        model = self.model
        hidden = model.embed(token_ids)
        for layer in range(model.num_layers):
            q, k, v = model.qkv(layer, model.attention_input(layer, hidden), positions)
            attn = attend(layer, q, k, v)
            hidden = model.mlp_block(layer, hidden + model.attention_output(layer, attn))
        return True


@pytest.mark.parametrize("selection", ["query_preview_last", "query_preview"])
@pytest.mark.parametrize("runs", [True, False])
def test_engine_preview_chooses_what_the_blender_preview_chooses(tiny, selection, runs) -> None:
    """A preview selection with a writer whose engine runs the preview: one engine pass of the
    preview's tokens (the uncached tail and the last token, at their positions), with the
    blender's attention, is one ``"preview"`` pass and gives the blender preview's selection and
    K/V (same adapter steps here, so the same numbers). An engine that declines leaves the
    preview to the blender, layer by layer."""
    _, model = tiny
    layers = model.config.num_hidden_layers
    blender, tokens, end = _reordered_request(model, ratios=(0.3,), selection=selection)
    reference = blender.blend(tokens, compute_end=end)
    engine = _PreviewEngine(blender, runs)
    blender.gpu_connector = engine
    seen, result = collect_steps(blender.blend_passes(tokens, compute_end=end))
    preview = [("preview", layers - 1)] if runs else [("preview", i) for i in range(layers)]
    assert seen == preview + [("blend", i) for i in range(layers)]
    ((ids, positions),) = engine.previews
    reusable = torch.nonzero(blender.start_request(tokens).valid_mask).flatten()
    tail = list(range(int(reusable[-1]) + 1, len(tokens)))
    assert positions[-len(tail) :] == tail and positions == sorted(positions)
    assert ids == [tokens[i] for i in positions]
    assert result.recomputed.tolist() == reference.recomputed.tolist()
    assert result.token_layers == reference.token_layers
    for layer in range(layers):
        torch.testing.assert_close(result.keys[layer], reference.keys[layer])
        torch.testing.assert_close(result.values[layer], reference.values[layer])


@pytest.mark.parametrize("selection", SELECTION_CHOICES)
def test_blending_never_writes_into_the_stores_entries(tiny, selection) -> None:
    """The blender only reads its hits (re-rotation, the preview's and the blend's rows go into
    a buffer of its own), so a memory tier may hand out its entries without a copy
    (``copy_on_get`` false, as the vLLM worker and the HF engine run it): blending, with and
    without an engine preview, leaves every entry as stored."""
    _, model = tiny
    blender, tokens, end = _reordered_request(model, ratios=(0.3,), selection=selection)
    store = blender.retriever.segment_cache.store
    store.copy_on_get = False
    stored = {key: (kv.keys.clone(), kv.values.clone()) for key, kv in store._entries.items()}
    assert stored
    blended = blender.blend(tokens, compute_end=end)
    assert blended.blended and blended.recomputed.numel()
    blender.blend(tokens)
    blender.gpu_connector = _PreviewEngine(blender)
    blender.blend(tokens, compute_end=end)
    for key, (keys, values) in stored.items():
        assert torch.equal(store._entries[key].keys, keys), key
        assert torch.equal(store._entries[key].values, values), key


def test_retriever_stacks_every_layers_hits_with_zero_rows_between() -> None:
    """``stacked``: each hit's rows of every layer in place, rows no hit covers zero (the
    uninitialised buffer must not leak into them), and the same rows as ``result(layer)``."""
    from lmcache_backend.blend.segments.retriever import SPTBlendRetrieverTask
    from lmcache_backend.storage.segments import SegmentKV

    g = torch.Generator().manual_seed(1)

    def kv(n: int, start: int) -> SegmentKV:
        return SegmentKV(
            torch.randn(3, n, 2, 4, generator=g), torch.randn(3, n, 2, 4, generator=g), start
        )

    task = SPTBlendRetrieverTask(
        [(0, kv(4, 0)), (6, kv(3, 9))], 11, torch.device("cpu"), torch.float32
    )
    keys, values = task.stacked(3)
    assert keys.shape == values.shape == (3, 11, 8)
    for rows in (slice(4, 6), slice(9, 11)):
        assert not keys[:, rows].any() and not values[:, rows].any()
    for layer in range(3):
        got = task.result(layer)
        torch.testing.assert_close(keys[layer], got.k)
        torch.testing.assert_close(values[layer], got.v)


@pytest.mark.parametrize("selection", ["query_preview_last", "query_preview", "kv_deviation"])
def test_blend_passes_step_through_the_preview_too(tiny, selection) -> None:
    """``blend_passes`` yields every layer pass (the preview's first), and gives the result of
    ``blend``; ``blend_layer`` still yields the blend's layers only."""
    _, model = tiny
    layers = model.config.num_hidden_layers
    blender, tokens, end = _reordered_request(model, ratios=(0.3,), selection=selection)
    seen, stepped = collect_steps(blender.blend_passes(tokens, compute_end=end))
    preview = [("preview", i) for i in range(layers)] if "preview" in selection else []
    assert seen == preview + [("blend", i) for i in range(layers)]
    whole = blender.blend(tokens, compute_end=end)
    assert stepped.recomputed.tolist() == whole.recomputed.tolist()
    for layer in range(layers):
        torch.testing.assert_close(stepped.keys[layer], whole.keys[layer], rtol=0, atol=0)
        torch.testing.assert_close(stepped.values[layer], whole.values[layer], rtol=0, atol=0)
    assert list(blender.blend_layer(tokens, compute_end=end)) == list(range(layers))


@pytest.mark.parametrize("selection", ["query_preview_last", "query_preview"])
@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_strict_end_changes_nothing_for_the_preview_selections(tiny, selection, ratio) -> None:
    """A preview selection never computes a token from ``compute_end`` on in a blend layer:
    ``strict_end`` gives the same selection and K/V."""
    _, model = tiny
    blender, tokens, end = _reordered_request(model, ratios=(ratio,), selection=selection)
    loose = blender.blend(tokens, compute_end=end)
    strict = blender.blend(tokens, compute_end=end, strict_end=True)
    assert strict.recomputed.tolist() == loose.recomputed.tolist()
    assert all(i < end for i in strict.recomputed.tolist())
    assert strict.token_layers == loose.token_layers
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(strict.keys[layer], loose.keys[layer], rtol=0, atol=0)
        torch.testing.assert_close(strict.values[layer], loose.values[layer], rtol=0, atol=0)


def test_strict_end_fallback_prefills_the_head_alone(tiny) -> None:
    """A fallback under ``strict_end`` is the full prefill of the tokens before ``compute_end``
    (their K/V do not depend on the later tokens); a check-layer selection refuses it."""
    _, model = tiny
    blender, cache = setup_blender(
        model, ratios=(0.3,), min_tokens=10_000, selection="query_preview"
    )
    warm_store(model, cache, rag_prompt(SYS, C1, Q1))
    tokens = rag_prompt(C1, SYS, Q1)
    end = len(tokens) - len(Q1)
    whole = blender.blend(tokens)
    head = blender.blend(tokens, compute_end=end, strict_end=True)
    assert not head.blended and head.logits is None
    assert head.recomputed.tolist() == list(range(end))
    assert head.token_layers == end * model.config.num_hidden_layers
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(head.keys[layer], whole.keys[layer][:end])
        torch.testing.assert_close(head.values[layer], whole.values[layer][:end])
    with pytest.raises(ValueError, match="strict_end needs compute_end"):
        blender.blend(tokens, strict_end=True)
    checking, cache = setup_blender(model, ratios=(0.3,), selection="kv_deviation")
    warm_store(model, cache, rag_prompt(SYS, C1, Q1))
    with pytest.raises(ValueError, match="strict_end"):
        checking.blend(tokens, compute_end=end, strict_end=True)


def test_blend_keeps_tenants_apart_through_cache_salt() -> None:
    """Every entry point takes the request's ``cache_salt``: a tenant reuses only the segments
    stored under its own salt (unsalted ones only without a salt)."""
    model = tiny_model("llama")
    blender, cache = setup_blender(model)
    warm_store(model, cache.salted("tenant-A"), rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    reusable = len(tokens) - len(Q2)
    assert blender.blend(tokens, cache_salt="tenant-A").num_reusable == reusable
    for salt in ("tenant-B", None):
        result = blender.blend(tokens, cache_salt=salt)
        assert result.num_reusable == 0, salt
    assert blender.blend(tokens).num_reusable == 0
    _, stepped = collect_steps(blender.blend_layer(tokens, cache_salt="tenant-A"))
    assert stepped.num_reusable == reusable
    assert blender.start_request(tokens, cache_salt="tenant-A").num_reusable == reusable


@pytest.mark.parametrize("entry", ["blend", "blend_layer", "blend_passes", "start_request"])
def test_an_unknown_request_field_is_refused_in_one_line(entry) -> None:
    blender, _ = setup_blender(tiny_model("llama"))
    tokens = rag_prompt(SYS, C1, Q1)
    with pytest.raises(TypeError) as err:
        call = getattr(blender, entry)(tokens, cache_slt="tenant-A")
        next(call) if entry in ("blend_layer", "blend_passes") else None
    message = str(err.value)
    assert "'cache_slt'" in message and "cache_salt" in message and "\n" not in message
    # LMCache's KV buffers are accepted by blend() and not used
    assert blender.blend(tokens, None, kvcaches=None, slot_mapping=None).num_tokens == len(tokens)
