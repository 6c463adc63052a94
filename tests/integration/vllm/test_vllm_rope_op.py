"""The vLLM adapter's RoPE on CPU: vLLM's fused C++ op in place of the module's eager code.

The op must compute what the module computes (its own ``cos_sin_cache``) in fp32 math rounded
once, the way vLLM's compiled graph runs the module, and the adapter must use it only for
modules that are plain RoPE over that table.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402

from lmcache_backend.models.vllm_layers import native_rotary  # noqa: E402

ROPES = {
    "default": {"rope_theta": 10000.0, "rope_type": "default"},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {
        "rope_theta": 10000.0,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
}


def _rope(name: str):
    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            64, 4096, is_neox_style=True, rope_parameters=ROPES[name], dtype=torch.float32
        )


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rope_op_is_the_modules_rope_rounded_once(name, dtype) -> None:
    """fp32: equal to the module's own code within 1e-6. bf16: every element equals the
    module's code run in fp32 and rounded once (what the compiled graph computes); the eager
    bf16 code, rounding after each op, differs by up to a few units in the last place."""
    rope = _rope(name)
    assert native_rotary(rope)
    g = torch.Generator().manual_seed(0)
    n, heads = 300, 9
    positions = torch.randperm(4096, generator=g)[:n]
    q = (4 * torch.randn(n, heads * 64, generator=g)).to(dtype)
    k = (4 * torch.randn(n, 3 * 64, generator=g)).to(dtype)
    table = rope.cos_sin_cache.to(dtype)
    q_op, k_op = q.clone(), k.clone()
    _custom_ops.rotary_embedding(positions, q_op, k_op, 64, table, True)
    q_ref, k_ref = RotaryEmbedding.forward_static(
        positions, q.float(), k.float(), 64, 64, table.float(), True
    )
    if dtype == torch.float32:
        torch.testing.assert_close(q_op, q_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k_op, k_ref, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(q_op, q_ref.to(dtype)) and torch.equal(k_op, k_ref.to(dtype))


def test_only_plain_rope_modules_take_the_fused_op() -> None:
    class ShiftedRope(RotaryEmbedding):  # computes something else than its table says
        def forward_native(self, positions, query, key=None):
            return super().forward_native(positions + 1, query, key)

    rope = _rope("default")
    with set_current_vllm_config(VllmConfig()):
        shifted = ShiftedRope(64, 64, 4096, 10000.0, True, torch.float32)
    assert native_rotary(rope) and not native_rotary(shifted)
    assert not native_rotary(torch.nn.Identity())
