"""vLLM ``hooks``: the symbols ``lmcache_backend`` uses (model methods, scheduler output fields,
runners, rotary embedding, attention attributes, custom ops, ...)."""

from __future__ import annotations

import ast
from typing import Any

from .sources import Sources, class_attribute, find_class, find_def, params, src
from .vllm_paths import WORKER_DIR

MODELS = "vllm/model_executor/models/"

SCHED_OUTPUT = "vllm/v1/core/sched/output.py"

ROTARY_PATHS = [
    "vllm/model_executor/layers/rotary_embedding.py",
    "vllm/model_executor/layers/rotary_embedding/base.py",
]

#: Where the hooks live: key -> candidate files (the first that defines the class wins).
HOOK_FILES: dict[str, list[str]] = {
    "llama": [MODELS + "llama.py"],
    "qwen2": [MODELS + "qwen2.py"],
    "qwen3": [MODELS + "qwen3.py"],
    "sched": [SCHED_OUTPUT],
    "request": ["vllm/v1/request.py"],
    "gpu_runner": [WORKER_DIR + "gpu_model_runner.py"],
    "cpu_runner": [WORKER_DIR + "cpu_model_runner.py"],
    "rotary": ROTARY_PATHS,
    "ops": ["vllm/_custom_ops.py"],
    "plugins": ["vllm/plugins/__init__.py"],
    "parallel": ["vllm/distributed/parallel_state.py"],
    "forward": ["vllm/forward_context.py"],
    "kv_config": ["vllm/config/kv_transfer.py", "vllm/config.py"],
}

#: (qualname, file key, kind); kind: function | attribute | class. ``_custom_ops.`` names a
#: module-level function of ``vllm/_custom_ops.py``.
HOOKS: list[tuple[str, str, str]] = [
    ("LlamaModel.get_input_embeddings", "llama", "function"),
    ("LlamaModel.embed_input_ids", "llama", "function"),
    ("Qwen2Model.get_input_embeddings", "qwen2", "function"),
    ("Qwen2Model.embed_input_ids", "qwen2", "function"),
    ("LlamaForCausalLM.compute_logits", "llama", "function"),
    ("Qwen3Attention.q_norm", "qwen3", "attribute"),
    ("Qwen3Attention.k_norm", "qwen3", "attribute"),
    ("CachedRequestData.resumed_from_preemption", "sched", "attribute"),
    ("CachedRequestData.resumed_req_ids", "sched", "attribute"),
    ("CachedRequestData.req_ids", "sched", "attribute"),
    ("CachedRequestData.new_block_ids", "sched", "attribute"),
    ("CachedRequestData.num_computed_tokens", "sched", "attribute"),
    ("NewRequestData.req_id", "sched", "attribute"),
    ("NewRequestData.prompt_token_ids", "sched", "attribute"),
    ("NewRequestData.block_ids", "sched", "attribute"),
    ("NewRequestData.num_computed_tokens", "sched", "attribute"),
    ("SchedulerOutput.scheduled_new_reqs", "sched", "attribute"),
    ("SchedulerOutput.scheduled_cached_reqs", "sched", "attribute"),
    ("SchedulerOutput.num_scheduled_tokens", "sched", "attribute"),
    ("Request.prompt_token_ids", "request", "attribute"),
    ("Request.request_id", "request", "attribute"),
    ("Request.kv_transfer_params", "request", "attribute"),
    ("GPUModelRunner.load_model", "gpu_runner", "function"),
    ("GPUModelRunner.get_model", "gpu_runner", "function"),
    ("CPUModelRunner.load_model", "cpu_runner", "function"),
    ("RotaryEmbedding", "rotary", "class"),
    ("RotaryEmbedding._compute_cos_sin_cache", "rotary", "function"),
    ("RotaryEmbedding.is_neox_style", "rotary", "attribute"),
    ("_custom_ops.cpu_attn_reshape_and_cache", "ops", "function"),
    ("load_general_plugins", "plugins", "function"),
    ("get_tensor_model_parallel_rank", "parallel", "function"),
    ("get_tensor_model_parallel_world_size", "parallel", "function"),
    ("get_tp_group", "parallel", "function"),
    ("set_forward_context", "forward", "function"),
    ("KVTransferConfig", "kv_config", "class"),
]

ATTN_ATTRS = (
    "qkv_proj",
    "o_proj",
    "rotary_emb",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "scaling",
)


def hook(s: Sources, paths: list[str], qual: str, kind: str) -> dict[str, Any] | None:
    for path in paths:
        tree = s.tree(path)
        if tree is None:
            continue
        if kind == "attribute":
            cls_name, attr = qual.split(".")
            if find_class(tree, cls_name) is None:
                continue
            owner = class_attribute(tree, cls_name, attr)
            if owner is None:
                return None
            return {"source": src(path, f"{owner}.{attr}")}
        node = find_def(tree, qual)
        if node is None and "." in qual:
            cls_name, meth = qual.split(".")
            owner = class_attribute(tree, cls_name, meth)  # a method of a base in this file
            if owner is not None and owner != cls_name:
                node, qual = find_def(tree, f"{owner}.{meth}"), f"{owner}.{meth}"
        if node is None:
            if "." in qual:
                cls = find_class(tree, qual.split(".")[0])
                if cls is not None:
                    return {
                        "source": None,
                        "inherited_from": [ast.unparse(b) for b in cls.bases],
                        "class_source": src(path, cls.name),
                    }
            continue
        if kind == "class":
            return {"source": src(path, qual)}
        return {"source": src(path, qual), "params": params(node)}
    return None


def hooks(s: Sources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, files, kind in HOOKS:
        out[label] = hook(s, HOOK_FILES[files], label.removeprefix("_custom_ops."), kind)
    for model_file, cls_name in (
        ("llama.py", "LlamaAttention"),
        ("qwen2.py", "Qwen2Attention"),
        ("qwen3.py", "Qwen3Attention"),
    ):
        path = MODELS + model_file
        tree = s.tree(path)
        missing = [a for a in ATTN_ATTRS if class_attribute(tree, cls_name, a) is None]
        out[f"{cls_name}.attributes"] = {"source": src(path, cls_name), "missing": missing}
    envs = s.text("vllm/envs.py") or ""
    out["envs.VLLM_CPU_ATTN_SPLIT_KV"] = (
        {"source": "vllm/envs.py::environment_variables"}
        if '"VLLM_CPU_ATTN_SPLIT_KV"' in envs
        else None
    )
    out["envs.VLLM_KV_CACHE_LAYOUT"] = (
        {"source": "vllm/envs.py::environment_variables"}
        if '"VLLM_KV_CACHE_LAYOUT"' in envs
        else None
    )
    return out
