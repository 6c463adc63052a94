"""Manual annotations: facts read from code as a whole (data flow across functions), which the
recorders do not derive. Each applies to a closed range of releases and names its source; a
fixture lists them under ``annotations`` with ``manual: true``."""

from __future__ import annotations

from typing import Any

from .releases import in_range

ANNOTATIONS: list[dict[str, Any]] = [
    {
        "package": "vllm",
        "range": ("0.9.2", "0.28.0"),
        "key": "registered_tensor",
        "fact": "register_kv_caches gets, per layer, the tensor _reshape_kv_cache_tensors builds: "
        "the layer's int8 buffer viewed as the spec dtype and as get_kv_cache_shape(...) "
        "permuted by get_kv_cache_stride_order(), then permuted back with .permute(*inv_order). "
        "So its shape is get_kv_cache_shape(...) and its memory order is the stride order "
        "(attention_backends.*.registered_tensor). From 0.11.2 the shape is computed for kernel "
        "blocks: num_blocks * (block_size // kernel_block_size) blocks of kernel_block_size "
        "tokens, where the backend's supported kernel block sizes exclude the manager's.",
        "source": "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._reshape_kv_cache_tensors",
    },
    {
        "package": "vllm",
        "range": ("0.12.0", "0.28.0"),
        "key": "cross_layer",
        "fact": "If the connector's prefer_cross_layer_blocks is True (a ClassVar in 0.12-0.13, a "
        "property from 0.14; False in the base class), the model has one attention group and "
        "the backend's get_kv_cache_stride_order(include_num_layers_dimension=True) has a layers "
        "dim, one buffer holds all layers (allocate_uniform_kv_caches) and the runner calls "
        "register_cross_layers_kv_cache(tensor, backend) instead of register_kv_caches.",
        "source": "vllm/v1/worker/kv_connector_model_runner_mixin.py::"
        "KVConnectorModelRunnerMixin.use_uniform_kv_cache",
    },
    {
        "package": "vllm",
        "range": ("0.29.0", "0.33.0"),
        "key": "registered_tensor",
        "fact": "register_kv_caches gets allocate_kv_cache's dict: per layer a 4-D view "
        "[B, H, N, C] = [num_blocks, num_kv_heads, block_size, head_size + head_size_v] of one "
        "int8 backing buffer (torch.as_strided, then .view(spec.dtype)), whose memory order is "
        "KVCacheLayout.layer_view_order of the resolved layout (LBNHC by default: memory "
        "[num_blocks, block_size, num_kv_heads, 2*head_size], not contiguous as [B, H, N, C]). "
        "FLASH_ATTN/FLASHINFER/TRITON_ATTN read K as C[:head_size] and V as C[head_size:] of each "
        "token; CPU_ATTN reads a (block, head) slab as [2*block_size, head_size], K rows then V "
        "rows (kv_read). B and N count kernel blocks when the backend "
        "splits manager blocks (kernel_block_sizes). The V1 and V2 runners both hand over "
        "these views; from 0.32 map_kv_caches_to_kernel_blocks re-views packed caches for the "
        "layers only.",
        "source": "vllm/v1/worker/utils.py::allocate_kv_cache + "
        "vllm/v1/kv_cache_interface.py::create_kv_cache_views",
    },
    {
        "package": "vllm",
        "range": ("0.29.0", "0.33.0"),
        "key": "cross_layer",
        "fact": "register_cross_layers_kv_cache and prefer_cross_layer_blocks are gone. Every "
        "KVCacheTensor puts its layers in one backing allocation (layer_stride, block_stride); "
        "with a block-outer layout (BLHNC, BLNHC, BHLNC: by VLLM_KV_CACHE_LAYOUT, the "
        "connector's get_required_kvcache_layout, or FlashInfer on SM100 offering BLHNC) a "
        "layer's block stride spans all layers of its tensor.",
        "source": "vllm/v1/kv_cache_interface.py::create_kv_cache_views",
    },
    {
        "package": "vllm",
        "range": ("0.9.2", "0.33.0"),
        "key": "register_kv_caches_keys",
        "fact": "Keys are the attention layers' prefixes, e.g. 'model.layers.0.self_attn.attn' "
        "for Llama/Qwen; a layer sharing another's KV cache (cross-layer KV sharing) maps to "
        "that layer's tensor.",
        "source": "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.initialize_kv_cache_tensors",
    },
    {
        "package": "vllm-ascend",
        "range": ("0.9.1", "0.9.1"),
        "key": "registered_tensor",
        "fact": "Non-MLA layer: a list [k_cache, v_cache], each get_kv_cache_shape(...)[1:] = "
        "[num_blocks, block_size, num_kv_heads, head_size] of kv_cache_spec.dtype, each its own "
        "2 MiB-aligned allocation. MLA: a tuple (nope_cache, rope_cache).",
        "source": "vllm_ascend/worker/model_runner_v1.py::NPUModelRunner.initialize_kv_cache",
    },
    {
        "package": "vllm-ascend",
        "range": ("0.11.0", "0.11.0"),
        "key": "registered_tensor",
        "fact": "Full attention: a tuple (k_cache, v_cache), each get_kv_cache_shape(...)[1:] = "
        "[num_blocks, block_size, num_kv_heads, head_size] of kv_cache_spec.dtype: two int8 "
        "allocations (2 MiB aligned when a KV transfer config is set), each through "
        "_convert_torch_format (npu_format_cast to ACL_FORMAT: FRACTAL_NZ on 310P, else ND). On "
        "310P the shape is [num_blocks, num_kv_heads*head_size//16, block_size, 16]; with "
        "additional_config kv_cache_dtype=int8 it is get_bsh_kv_cache_shape; with hybrid "
        "blocks num_blocks/block_size are the kernel's (get_supported_block_size).",
        "source": "vllm_ascend/worker/model_runner_v1.py::NPUModelRunner."
        "initialize_kv_cache_tensors",
    },
    {
        "package": "vllm-ascend",
        "range": ("0.13.0", "0.23.0.post1"),
        "key": "registered_tensor",
        "fact": "Full attention: a tuple (k_cache, v_cache), each [num_blocks, block_size, "
        "num_kv_heads, head_size] (get_kv_cache_shape(...)[1:]; from 0.18.0 V uses "
        "head_size_v when the spec has it), views of two separate int8 allocations; "
        "sparse/DSA models append indexer caches to the tuple. dtype: kv_cache_spec.dtype; "
        "the quant config's KV dtype (int8) when enable_fa_quant holds (0.18.0: only on a KV "
        "consumer). With hybrid blocks num_blocks/block_size are the kernel's.",
        "source": "vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._reshape_kv_cache_tensors",
    },
]


def annotations_for(package: str, version: str) -> list[dict[str, str]]:
    return [
        {"key": a["key"], "fact": a["fact"], "source": a["source"], "manual": True}
        for a in ANNOTATIONS
        if a["package"] == package and in_range(version, *a["range"])
    ]
