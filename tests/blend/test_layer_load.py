"""The per-layer load of a request's hits (:class:`LayerLoader`): every layer's rows, hits at
their starts and zero rows between them, whether they are assembled in place (the hits on the
compute device, one ``cat`` for K and one for V), in a staging buffer on loader threads, or
copied hit by hit by those threads (the hits in host memory, the blend on a GPU; both forced here
on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from lmcache_backend.blend.layerwise.layer_load import LOAD_MODES, LayerLoader
from lmcache_backend.storage.segments import SegmentKV

LAYERS, TOKENS, HEADS, DIM = 4, 50, 2, 8


def _hits(g: torch.Generator) -> list[tuple[int, SegmentKV]]:
    """Three hits, given out of order: a gap before the first, between two, after the last."""
    spans = [(20, 9), (3, 12), (30, 14)]
    return [
        (start, SegmentKV(torch.randn(LAYERS, n, HEADS, DIM, generator=g),
                          torch.randn(LAYERS, n, HEADS, DIM, generator=g), 0))
        for start, n in spans
    ]  # fmt: skip


def _expected(hits, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = torch.zeros(TOKENS, HEADS, DIM), torch.zeros(TOKENS, HEADS, DIM)
    for start, kv in hits:
        keys[start : start + kv.num_tokens] = kv.keys[layer]
        values[start : start + kv.num_tokens] = kv.values[layer]
    return keys, values


def _buffers() -> list[tuple[torch.Tensor, torch.Tensor]]:
    # NaN: a row the loader forgot would show
    return [
        (torch.full((TOKENS, HEADS, DIM), float("nan")),
         torch.full((TOKENS, HEADS, DIM), float("nan")))
        for _ in range(2)
    ]  # fmt: skip


@pytest.mark.parametrize("mode", LOAD_MODES)
def test_every_layer_arrives_whole_with_zero_gaps(mode) -> None:
    hits = _hits(torch.Generator().manual_seed(0))
    loader = LayerLoader(hits, LAYERS, TOKENS, _buffers(), mode=mode)
    assert loader.mode == mode
    try:
        loader.start(0)
        for layer in range(LAYERS):
            keys, values = loader.wait(layer)
            loader.start(layer + 1)  # the next layer loads while this one is read
            want_k, want_v = _expected(hits, layer)
            assert torch.equal(keys, want_k) and torch.equal(values, want_v), layer
            keys.add_(1.0)  # the blend scatters into the buffer; the next load overwrites
    finally:
        loader.close()


def test_a_request_without_hits_loads_zero_rows() -> None:
    """Only vLLM's prefix cache reused: every layer's rows start at zero (the prefix is filled
    in afterwards)."""
    loader = LayerLoader([], LAYERS, TOKENS, _buffers())
    for layer in range(LAYERS):
        keys, values = loader.wait(layer)
        assert not keys.any() and not values.any()
    loader.close()


def test_hits_on_the_compute_device_are_assembled_in_place() -> None:
    """CPU hits for CPU buffers: no staging, no loader thread (one ``cat`` per K and V)."""
    loader = LayerLoader(_hits(torch.Generator().manual_seed(1)), LAYERS, TOKENS, _buffers())
    assert loader.mode == "in place" and not loader._pools
    loader.close()


def test_hits_in_two_places_are_moved_part_by_part() -> None:
    """Hits from two tiers (host memory and another device) cannot be assembled in one place:
    each part is moved to the buffers' device first. The "meta" device stands in for the
    other place: only where the parts live matters, not their values."""
    hits = _hits(torch.Generator().manual_seed(2))
    start, kv = hits[0]
    hits[0] = (start, SegmentKV(kv.keys.to("meta"), kv.values.to("meta"), 0))
    loader = LayerLoader(hits, LAYERS, TOKENS, _buffers())
    assert loader._mixed and loader.mode == "in place"
    loader.close()


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown load mode 'copied'"):
        LayerLoader([], LAYERS, TOKENS, _buffers(), host_load="copied")
