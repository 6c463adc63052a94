"""STAND-IN for vLLM's compiled CUDA extension ``vllm._C_stable_libtorch`` (a 79 MB shared
library in vLLM 0.26.0's CUDA wheel), written for lmcache-backend's hardware check. It is not
vLLM's code.

The extension registers vLLM's CUDA kernels as ``torch.ops._C.<name>``. On the path the check
selects (``custom_ops=["none"]``, the IR ops ``rms_norm`` / ``fused_add_rms_norm`` on their
``native`` implementation, ``attention_backend="TRITON_ATTN"``, eager) vLLM computes with torch
and Triton, but its Python still touches a few of these ops. This module registers exactly those,
with the extension's own schemas, in plain torch:

* capability probes (:data:`PROBES`), asked at import and when kernels are picked: they answer
  "unsupported", which keeps vLLM on its other paths;
* ops whose *names* vLLM reads while importing or building layers although their native path runs
  (:data:`NAMED_ONLY`: e.g. ``SiluAndMul.__init__`` reads ``silu_and_mul``; the compilation
  passes' pattern tables read the quantization ops). Calling one raises :class:`StandInOpCalled`,
  naming the op: vLLM took a path this stand-in does not cover (a custom op enabled, another
  attention backend), and the check reports that op instead of computing it slowly.

An op vLLM needs that is in neither list fails as ``'_OpNamespace' '_C' object has no attribute
'<name>'``, which the check also reports by name.
"""

from __future__ import annotations

import torch

#: marks this module as the stand-in (the hardware check's rows say which one ran)
STAND_IN = True

#: capability probes: name -> schema (vLLM 0.26.0's extension)
PROBES = {
    "cutlass_scaled_mm_supports_fp8": "(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_block_fp8": "(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_fp4": "(int cuda_device_capability) -> bool",
    "cutlass_group_gemm_supported": "(int cuda_device_capability) -> bool",
}

#: ops vLLM names on this path but never calls: name -> schema (vLLM 0.26.0's extension)
NAMED_ONLY = {
    "silu_and_mul": "(Tensor! result, Tensor input) -> ()",
    "rotary_embedding": (
        "(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
        "bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()"
    ),
    "rms_norm": "(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm": (
        "(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()"
    ),
    "static_scaled_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()"
    ),
    "dynamic_scaled_fp8_quant": "(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()"
    ),
    "rms_norm_static_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()"
    ),
    "fused_add_rms_norm_static_fp8_quant": (
        "(Tensor! result, Tensor input, Tensor! residual, Tensor weight, Tensor scale, "
        "float epsilon) -> ()"
    ),
    "rms_norm_dynamic_per_token_quant": (
        "(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
        "Tensor? scale_ub, Tensor!? residual) -> ()"
    ),
    "silu_and_mul_quant": "(Tensor! result, Tensor input, Tensor scale) -> ()",
    "fused_qk_norm_rope": (
        "(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, "
        "float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, "
        "Tensor position_ids, int forced_token_heads_per_warp=-1) -> ()"
    ),
}


class StandInOpCalled(RuntimeError):
    """vLLM called an op the stand-in only names (see the module docstring)."""


_LIB = torch.library.Library("_C", "FRAGMENT")


def _unsupported(cuda_device_capability: int) -> bool:
    return False


def _named_only(name: str):
    def call(*args, **kwargs):
        raise StandInOpCalled(
            f"vLLM called torch.ops._C.{name}: the compiled extension is replaced by a stand-in "
            "that only names this op; this path needs vLLM's native/Triton code for it"
        )

    return call


for _name, _schema in PROBES.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _unsupported, "CompositeExplicitAutograd")
for _name, _schema in NAMED_ONLY.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _named_only(_name), "CompositeExplicitAutograd")
