"""Re-rotation of cached keys on a model with several RoPE tables (Gemma 3's local and global
layers), through the engine's own kernel: each layer turns with its own table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache_backend.blend.layerwise.cached_kv import _rerotate
from lmcache_backend.ops import get_ops
from lmcache_backend.ops.reference import rope_rerotate_k


def _table(base: float, positions: int, dim: int) -> torch.Tensor:
    """A plain RoPE ``[positions, dim]`` table (cosines, then sines)."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def test_each_layer_turns_with_its_own_table_through_the_engine_kernel() -> None:
    torch.manual_seed(0)
    layers, tokens, heads, dim = 5, 40, 2, 16
    local, global_ = _table(10_000.0, 128, dim), _table(1_000_000.0, 128, dim)
    groups = [(local, [0, 1, 3, 4]), (global_, [2])]
    calls = []

    def engine_kernel(k, old, new, table=None):  # stands for vLLM's CPU rotary op
        calls.append(table)
        return rope_rerotate_k(k, old, new, table, True)

    model = SimpleNamespace(rotation_groups=lambda: groups, rope_rerotate_k=engine_kernel)
    compute = SimpleNamespace(model=model, ops=get_ops("torch"))
    original = torch.arange(tokens) + 3  # where the rows were computed
    positions = torch.arange(tokens) + 50  # where the prompt puts them now
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[7] = False  # an uncached row: not turned
    meta = SimpleNamespace(valid_mask=valid, positions=positions)
    keys = torch.randn(layers, tokens, heads, dim)
    expected = keys.clone()
    _rerotate(keys, original, meta, compute)
    for table, group in groups:
        for layer in group:
            want = expected[layer].clone()
            want[valid] = rope_rerotate_k(
                expected[layer][valid].clone(), original[valid], positions[valid], table, True
            )
            torch.testing.assert_close(keys[layer], want, rtol=1e-5, atol=1e-5)
    assert [id(t) for t in calls] == [id(local), id(global_)]  # one call per table


def test_vllm_adapter_kernel_takes_any_table() -> None:
    """The vLLM adapter's re-rotation through vLLM's CPU rotary op, given a table, equals the
    reference with that table (within one bf16 rounding), for two tables in turn."""
    pytest.importorskip("vllm")
    from lmcache_backend.models.vllm import VLLMModelAdapter
    from lmcache_backend.models.vllm_layers import cpu_rotary_op

    if cpu_rotary_op() is None:
        pytest.skip("vLLM's CPU rotary op is not available")
    torch.manual_seed(1)
    first, second = _table(10_000.0, 256, 64), _table(1_000_000.0, 256, 64)
    adapter = SimpleNamespace(cos_sin_cache=first, _delta_caches={}, is_neox=True)
    old, new = torch.randint(0, 256, (30,)), torch.randint(0, 256, (30,))
    for table in (second, first, None):
        k = torch.randn(30, 3, 64).to(torch.bfloat16)
        want = rope_rerotate_k(k.clone(), old, new, first if table is None else table, True)
        got = VLLMModelAdapter.rope_rerotate_k(adapter, k.clone(), old, new, table)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    other = rope_rerotate_k(k.clone(), old, new, second, True)
    assert (got.float() - other.float()).abs().max() > 0.1  # the tables differ
