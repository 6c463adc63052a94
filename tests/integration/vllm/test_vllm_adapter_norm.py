"""The vLLM adapter's RMSNorm off the CPU: an fp32 input (the unrounded residual stream) must not
reach vLLM's fused CUDA kernel, which reads the weight in the input's dtype (vLLM 0.9-0.11 in
eager mode); it goes through the op's PyTorch path. A ``meta`` tensor stands for a device one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from lmcache_backend.models.vllm import rms_norm  # noqa: E402


class _FusedOnly(torch.nn.Module):
    """vLLM's RMSNorm as the fused kernel sees it: any input whose dtype is not the weight's
    reads the weight wrongly (here: refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        self.native_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" and x.dtype != self.weight.dtype:
            raise AssertionError("the fused kernel got an fp32 input with a bf16 weight")
        return x.clone()

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        self.native_calls += 1
        return x.clone()


def test_fp32_input_on_a_device_takes_the_native_path() -> None:
    norm = _FusedOnly()
    out = rms_norm(norm, torch.zeros(3, 8, dtype=torch.float32, device="meta"), torch.bfloat16)
    assert norm.native_calls == 1 and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out = rms_norm(norm, torch.zeros(3, 8, dtype=torch.bfloat16, device="meta"), torch.bfloat16)
    assert norm.native_calls == 1  # the model's dtype: the fused op is right
    out = rms_norm(norm, torch.ones(3, 8), torch.bfloat16)  # CPU: vLLM's eager op is native
    assert norm.native_calls == 1 and out.dtype == torch.bfloat16


def test_vllms_rmsnorm_has_the_native_path() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(8)
        x = torch.randn(3, 8)
        torch.testing.assert_close(norm.forward_native(x), norm(x))
