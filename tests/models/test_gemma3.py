"""Gemma 3 (``gemma3_text``) through the HF adapter and the blender, on a tiny random-weight
model (``tiny_hf.GEMMA3``, fp32): sliding-window layers (window 16, far shorter than the
prompts) with the local RoPE base, global layers with another base and linear scaling, q/k
norms, head dim 32 != hidden / heads, softmax scale ``24 ** -0.5``."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close, relative_error
from tiny_hf import (
    C1,
    C2,
    C3,
    GEMMA3_WINDOW,
    Q1,
    Q2,
    SEP,
    SYS,
    rag_prompt,
    rand_ids,
    setup_blender,
    tiny_model,
    warm_store,
)

from lmcache_backend.integration.hf.engine import hf_full_prefill
from lmcache_backend.models.base import UnsupportedModelError
from lmcache_backend.models.gemma3 import Gemma3Adapter
from lmcache_backend.models.hf import HFModelAdapter
from lmcache_backend.ops.reference import attention_at_positions, rope_rerotate_k

LOCAL, GLOBAL = 1, 2  # a sliding-window layer and a global one of the tiny model


@pytest.fixture(scope="module")
def gemma() -> torch.nn.Module:
    return tiny_model("gemma3")


@torch.no_grad()
def _layer_by_layer(adapter, ids: list[int], window_shift: int = 0):
    """The adapter's steps over a whole prompt with the reference attention (each layer's
    window moved by ``window_shift``): ``[T, vocab]`` logits and per-layer K/V."""
    tokens = torch.tensor(ids)
    positions = torch.arange(len(ids))
    hidden = adapter.embed(tokens)
    keys, values = [], []
    for layer in range(adapter.num_layers):
        q, k, v = adapter.qkv(layer, adapter.attention_input(layer, hidden), positions)
        keys.append(k)
        values.append(v)
        window = adapter.sliding_window(layer)
        kw = {} if window is None else {"window": window + window_shift}
        attn = attention_at_positions(q, k, v, positions, adapter.attn_scale, **kw)
        hidden = adapter.mlp_block(layer, hidden + adapter.attention_output(layer, attn))
    return adapter.logits(hidden), keys, values


def test_adapter_reads_the_layer_kinds(gemma) -> None:
    adapter = HFModelAdapter(gemma)
    assert isinstance(adapter, Gemma3Adapter)
    w = GEMMA3_WINDOW
    assert [adapter.sliding_window(i) for i in range(4)] == [w, w, None, w]
    assert adapter.max_exact_tokens is None  # windows are reproduced, not a length limit
    assert adapter.attn_scale == pytest.approx(24**-0.5)
    assert adapter.head_dim == 32
    (local, local_layers), (glob, global_layers) = adapter.rotation_groups()
    assert local_layers == [0, 1, 3] and global_layers == [2]
    assert not torch.equal(local, glob)
    assert [layer for _, layer in adapter.layer_kinds()] == [0, 2]


def test_layer_by_layer_forward_equals_transformers(gemma) -> None:
    """Logits of every position and every layer's K/V equal transformers' own forward pass,
    over a prompt three windows long."""
    ids = rand_ids(56, 7)
    adapter = HFModelAdapter(gemma)
    logits, keys, values = _layer_by_layer(adapter, ids)
    with torch.no_grad():
        reference = gemma(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert_close(logits, reference, torch.float32)
    full = hf_full_prefill(gemma, ids)
    assert all(k.shape[0] == len(ids) for k in full.keys)  # every row, window layers too
    for layer in range(adapter.num_layers):
        assert_close(keys[layer], full.keys[layer], torch.float32)
        assert_close(values[layer], full.values[layer], torch.float32)


@pytest.mark.parametrize("shift", [-1, 1])
def test_window_convention_is_transformers(gemma, shift) -> None:
    """A window one key shorter or longer gives other logits: the convention (a query at
    ``p`` sees keys ``p - window + 1 .. p``) is the one the test above matches."""
    ids = rand_ids(56, 7)
    logits, _, _ = _layer_by_layer(HFModelAdapter(gemma), ids, window_shift=shift)
    with torch.no_grad():
        reference = gemma(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert float((logits - reference).abs().max()) > 1e-2


def _ratio_one(model, selection: str):
    """A ratio-1.0 blend of a reordered prompt and the full prefill of that prompt."""
    blender, cache = setup_blender(model, ratios=(1.0,), selection=selection)
    warm_store(model, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    reordered = rag_prompt(SYS, C3, C1, C2, Q2)
    assert len(reordered) > 8 * GEMMA3_WINDOW
    result = blender.blend(reordered)
    assert result.blended and result.num_reusable == len(reordered) - len(Q2)
    return result, hf_full_prefill(model, reordered)


@pytest.mark.parametrize("selection", ["kv_deviation", "query_preview_last"])
def test_ratio_one_equals_full_prefill(gemma, selection) -> None:
    result, full = _ratio_one(gemma, selection)
    assert_close(result.logits, full.logits, torch.float32)
    for layer in range(gemma.config.num_hidden_layers):
        assert_close(result.keys[layer], full.keys[layer], torch.float32)
        assert_close(result.values[layer], full.values[layer], torch.float32)


def test_ignoring_the_window_breaks_ratio_one(gemma, monkeypatch) -> None:
    """The same blend with every layer's window switched off attends too far back: it no
    longer equals full prefill, so the test above guards the window."""
    monkeypatch.setattr(Gemma3Adapter, "sliding_window", lambda self, layer: None)
    result, full = _ratio_one(gemma, "kv_deviation")
    assert float((result.logits - full.logits).abs().max()) > 1e-2


@pytest.mark.parametrize("layer", [LOCAL, GLOBAL], ids=["local", "global"])
def test_rerotation_uses_the_layers_table(gemma, layer) -> None:
    """Keys computed at ``p`` and re-rotated to ``p + 97`` with the layer's table equal keys
    computed there; the other kind's table does not."""
    adapter = HFModelAdapter(gemma)
    ids = torch.tensor(rand_ids(40, 8))
    with torch.no_grad():
        x = adapter.attention_input(layer, adapter.embed(ids))
        old = torch.arange(40)
        new = old + 97
        _, k_old, _ = adapter.qkv(layer, x, old)
        _, k_new, _ = adapter.qkv(layer, x, new)
    moved = rope_rerotate_k(k_old.clone(), old, new, adapter.rotation_table(layer), True)
    assert relative_error(moved, k_new) < 1e-5
    other = adapter.rotation_table(GLOBAL if layer == LOCAL else LOCAL)
    wrong = rope_rerotate_k(k_old.clone(), old, new, other, True)
    assert relative_error(wrong, k_new) > 1e-2


def test_blend_rerotates_each_layer_with_its_table(gemma) -> None:
    """Ratio 0 on a reordered prompt: a reused chunk's keys in a local and a global layer are
    its cached keys moved with that layer's table."""
    blender, cache = setup_blender(gemma, ratios=(0.0,))
    first = rag_prompt(SYS, C1, C2, Q1)
    warm_store(gemma, cache, first)
    result = blender.blend(rag_prompt(SYS, C2, C1, Q1))
    warm = hf_full_prefill(gemma, first)
    c1_old = len(SYS) + len(SEP)
    c1_new = c1_old + len(C2) + len(SEP)
    n = len(C1) + len(SEP)
    for layer in (LOCAL, GLOBAL):
        expected = rope_rerotate_k(
            warm.keys[layer][c1_old : c1_old + n].clone(),
            torch.arange(c1_old, c1_old + n),
            torch.arange(c1_new, c1_new + n),
            blender.model.rotation_table(layer),
            True,
        )
        assert_close(result.keys[layer][c1_new : c1_new + n], expected, torch.float32)


def _refusal(model, **changes) -> str:
    config = model.config
    saved = {name: getattr(config, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(config, name, value)
        with pytest.raises(UnsupportedModelError) as raised:
            HFModelAdapter(model)
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
    message = str(raised.value)
    assert "\n" not in message and isinstance(raised.value, ValueError)
    return message


def test_unreproducible_layers_are_refused_in_one_line(gemma) -> None:
    kinds = ["sliding_attention", "chunked_attention", "full_attention", "sliding_attention"]
    message = _refusal(gemma, layer_types=kinds)
    assert message == (
        "model_type 'gemma3_text': layer kind 'chunked_attention' (layer 1) is not supported "
        "(supported: full_attention, sliding_attention)"
    )
    assert "attn_logit_softcapping=50.0" in _refusal(gemma, attn_logit_softcapping=50.0)
    assert "bidirectional" in _refusal(gemma, use_bidirectional_attention=True)
    rope = {**gemma.config.rope_parameters, "full_attention": {"rope_type": "dynamic"}}
    assert "'dynamic' RoPE on full_attention layers" in _refusal(gemma, rope_parameters=rope)
    assert "model_type 'gemma3'" in _refusal(gemma, model_type="gemma3")


def test_verify_prints_the_refusal(gemma, tmp_path, capsys) -> None:
    """``lmcache-backend verify`` on a refused model: the one line, exit code 2."""
    import shutil

    from lmcache_backend.cli import main
    from lmcache_backend.data.embedded import embedded_model_path

    source = embedded_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    gemma.config.attn_logit_softcapping = 50.0
    try:
        gemma.save_pretrained(tmp_path)
    finally:
        gemma.config.attn_logit_softcapping = None
    assert main(["verify", str(tmp_path), "--prompts", "1"]) == 2
    err = capsys.readouterr().err  # transformers' progress bars, then the refusal
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lmcache-backend verify: ") and "attention logit softcapping" in last


def test_verify_checks_every_layer_kind(tmp_path, capsys) -> None:
    """``lmcache-backend verify`` on a tiny Gemma 3 with the embedded tokenizer: it passes, and
    re-rotation is checked on a local and a global layer."""
    import json
    import shutil

    from tiny_hf import GEMMA3
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from lmcache_backend.cli import main
    from lmcache_backend.data.embedded import embedded_model_path

    source = embedded_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        **GEMMA3,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    assert main(["verify", str(tmp_path), "--prompts", "1", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out, out
    assert f"PASS  re-rotation error (layer 0, window {GEMMA3_WINDOW})" in out, out
    assert "PASS  re-rotation error (layer 2, global)" in out, out
    assert "PASS  ratio 1.0: max first-token logit difference" in out, out


def test_bench_prefix_caching_keeps_every_row_of_the_windowed_layers(gemma) -> None:
    """The HF benchmark's prefix-caching strategy on a prompt four windows long: its K/V (what
    decoding continues from) are full prefill's in every layer, windowed ones included, not the
    last window alone (fp32 tolerance of numerics.py)."""
    from lmcache_backend.bench.quality.hf_engine import HFEngine
    from lmcache_backend.bench.quality.strategies import PREFIX, Strategy

    ids = rand_ids(4 * GEMMA3_WINDOW, 11)
    bench = HFEngine.__new__(HFEngine)  # the prefix path needs only the model and its prompts
    bench.model, bench.num_layers = gemma, gemma.config.num_hidden_layers
    first = hf_full_prefill(gemma, ids)
    bench._prompts = [(ids, first.keys, first.values)]
    asked = ids[: 2 * GEMMA3_WINDOW] + rand_ids(2 * GEMMA3_WINDOW, 12)
    run = bench.prefill(Strategy("prefix caching", PREFIX, block_size=1), asked)
    full = hf_full_prefill(gemma, asked)
    assert run.reused_tokens == 2 * GEMMA3_WINDOW
    assert_close(run.logits, full.logits, torch.float32)
    for layer in range(bench.num_layers):
        assert run.state.keys[layer].shape == full.keys[layer].shape, layer
        assert_close(run.state.keys[layer], full.keys[layer], torch.float32)
        assert_close(run.state.values[layer], full.values[layer], torch.float32)


def test_preview_scores_only_the_layers_that_see_the_whole_prompt(gemma, monkeypatch) -> None:
    """``blend_preview_scored_layers="global"`` (the default): a sliding-window layer shorter
    than the prompt reads only its end, so its reads do not count. The windowed layers read
    tokens 40 and 41 far more than the global layers read 90 and 100: scoring every layer
    recomputes the first pair, the default the second."""
    import lmcache_backend.blend.selectors.preview_mass as preview_mass

    real = preview_mass.attention_with_query_mass

    def fake(q, k, v, positions, scale, rows, **kw):
        out, _, last = real(q, k, v, positions, scale, rows, **kw)
        mass = torch.zeros(k.shape[0])
        windowed = kw.get("window") is not None
        mass[[40, 41] if windowed else [90, 100]] = 100.0 if windowed else 1.0
        return out, mass, torch.zeros_like(last)

    monkeypatch.setattr(preview_mass, "attention_with_query_mass", fake)
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    assert len(tokens) > GEMMA3_WINDOW
    chosen = {}
    for which in ("global", "all"):
        blender, cache = setup_blender(gemma, ratios=(0.02,), selection="query_preview")
        warm_store(gemma, cache, rag_prompt(SYS, C1, C2, C3, Q1))
        config = blender.config.replace(blend_preview_scored_layers=which)
        result = blender.blend(tokens, config=config)
        chosen[which] = set(result.recomputed.tolist()) & {40, 41, 90, 100}
    assert chosen["global"] == {90, 100}
    assert chosen["all"] == {40, 41}
