"""The blend into a target that ``streams_layers`` (a device's paged cache): the cached K/V are
retrieved one layer at a time, each layer's rows go into the paged cache before it is computed,
and the selected queries attend there through the block table. The rows it leaves in the paged
cache equal the layer-by-layer blend's K/V, and it never holds every layer's cached K/V.

The tiny model, its store and the paged cache are on :data:`conftest.DEVICE`: with the ``cuda``
backend the Triton kernels run compiled on the GPU when one is visible, else through Triton's
interpreter on CPU tensors; the torch reference ops run on either."""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE
from tiny_hf import C1, C2, C3, Q1, Q2, SYS, rag_prompt, setup_blender, tiny_model, warm_store

from lmcache_backend import ops as ops_registry
from lmcache_backend.blend import KVTarget
from lmcache_backend.blend.layerwise.layer_load import LayerLoader
from lmcache_backend.ops import Ops, get_ops

BLOCK_SIZE = 16


class StreamingPagedKV(KVTarget):
    """A paged cache on the model's device: per layer ``[NB, BS, Hkv, D]`` K and V (NaN until
    written), the request's blocks in a shuffled order, attention through the op registry's
    ``paged_attention_at_positions``."""

    paged_attention = True
    streams_layers = True

    def __init__(self, model, num_tokens: int, ops: Ops, dtype=torch.float32) -> None:
        blocks = (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
        g = torch.Generator().manual_seed(num_tokens)
        self.table = torch.randperm(blocks + 2, generator=g)[:blocks].to(model.device)
        shape = (blocks + 2, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        nan = float("nan")
        self.caches = [
            tuple(torch.full(shape, nan, dtype=dtype, device=model.device) for _ in range(2))
            for _ in range(model.num_layers)
        ]
        self.ops, self.calls = ops, {"write_rows": 0, "attention": 0}

    def _slots(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.table.device)
        return self.table[rows // BLOCK_SIZE] * BLOCK_SIZE + rows % BLOCK_SIZE

    def write_rows(self, layer_id, rows, keys, values) -> None:
        self.calls["write_rows"] += 1
        k_cache, v_cache = self.caches[layer_id]
        self.ops.paged_kv_write(keys, values, k_cache, v_cache, self._slots(rows))

    def attention(self, layer_id, q, positions, scale, keys, values, window=None) -> torch.Tensor:
        self.calls["attention"] += 1
        k_cache, v_cache = self.caches[layer_id]
        if window is not None:  # a sliding-window layer: the reference over the rows read back
            keys, values = self.rows(layer_id, int(positions.max()) + 1)
            return self.ops.attention_at_positions(q, keys, values, positions, scale, window=window)
        return self.ops.paged_attention_at_positions(
            q, k_cache, v_cache, self.table, positions, scale
        )

    def rows(self, layer_id: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's rows of tokens ``0..end-1``, ``[end, Hkv, D]`` each."""
        k_cache, v_cache = self.caches[layer_id]
        rows = torch.arange(end, device=self.table.device)
        return self.ops.paged_kv_read(k_cache, v_cache, self._slots(rows))


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_model("llama").to(DEVICE)


@pytest.mark.parametrize("backend", ["torch", "cuda"])
@pytest.mark.parametrize("selection", ["query_preview_last", "kv_deviation"])
def test_streamed_blend_leaves_the_layerwise_blends_rows(llama, selection, backend) -> None:
    if backend == "cuda":
        pytest.importorskip("triton")
    blender, cache = setup_blender(llama, ratios=(0.3,), selection=selection)
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    end = len(tokens) - len(Q2)
    reference = blender.blend(tokens, compute_end=end)
    ops = get_ops(backend)  # cuda: compiled on the GPU, else Triton's interpreter
    blender.compute = type(blender.compute)(blender.model, ops)
    target = StreamingPagedKV(blender.model, len(tokens), ops)
    blender.gpu_connector = target
    ops_registry._declined_logged.clear()
    streamed = blender.blend(tokens, compute_end=end)
    assert streamed.blended and streamed.keys == [] and streamed.values == []
    # every op call the kernels got ran a kernel (a tensor left on the CPU beside a GPU would be
    # declined and answered by the reference)
    assert [entry for entry in ops_registry._declined_logged if entry[0] == "cuda"] == []
    assert torch.equal(streamed.recomputed, reference.recomputed)
    assert target.calls["attention"] > 0
    for layer in range(blender.model.num_layers):
        keys, values = target.rows(layer, end)
        assert keys.device.type == DEVICE
        assert not torch.isnan(keys).any(), f"layer {layer}: a row was never written"
        torch.testing.assert_close(keys, reference.keys[layer][:end], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values, reference.values[layer][:end], rtol=1e-4, atol=1e-4)


def test_streamed_gemma3_blend_rerotates_each_layer_with_its_table() -> None:
    """Gemma 3: each streamed layer is re-rotated with its own table (local or global RoPE) and
    its sliding window reaches the target; the rows equal the layer-by-layer blend's."""
    model = tiny_model("gemma3").to(DEVICE)
    blender, cache = setup_blender(model, ratios=(0.3,), selection="query_preview_last")
    warm_store(model, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    end = len(tokens) - len(Q2)
    reference = blender.blend(tokens, compute_end=end)
    target = StreamingPagedKV(blender.model, len(tokens), get_ops("torch"))
    blender.gpu_connector = target
    streamed = blender.blend(tokens, compute_end=end)
    assert streamed.blended and torch.equal(streamed.recomputed, reference.recomputed)
    for layer in range(blender.model.num_layers):
        keys, values = target.rows(layer, end)
        torch.testing.assert_close(keys, reference.keys[layer][:end], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values, reference.values[layer][:end], rtol=1e-4, atol=1e-4)


def test_the_stream_holds_two_layers_and_never_every_layer(llama, monkeypatch) -> None:
    """No ``[L, T, Hkv, D]`` buffer is built: the whole-request retrieval is never called, and
    each layer is fetched once (by the preview) although the blend runs every layer again."""
    blender, cache = setup_blender(llama, ratios=(0.3,), selection="query_preview_last")
    warm_store(llama, cache, rag_prompt(SYS, C1, C2, C3, Q1))
    tokens = rag_prompt(SYS, C3, C1, C2, Q2)
    fetched: list[int] = []
    real_wait = LayerLoader.wait

    def counting_wait(self, layer_id):
        fetched.append(layer_id)
        return real_wait(self, layer_id)

    def no_whole_request(*_):
        raise AssertionError("every layer's K/V were built at once")

    monkeypatch.setattr(LayerLoader, "wait", counting_wait)
    monkeypatch.setattr("lmcache_backend.blend.layerwise.cached_kv.cached_layers", no_whole_request)
    blender.gpu_connector = StreamingPagedKV(blender.model, len(tokens), get_ops("torch"))
    result = blender.blend(tokens, compute_end=len(tokens) - len(Q2))
    assert result.blended
    assert fetched == list(range(blender.model.num_layers))
