"""The vLLM symbols every code path of the integration uses, whatever the release.

:meth:`lmcache_backend.compat.profile.VllmProfile.required_symbols` adds the release-specific ones
to this list. Each is checked against every recorded release
(``tests/compat/test_vllm_compat.py``) and, for a release with no record, against its installed
source (:mod:`lmcache_backend.compat.probe`).
"""

from __future__ import annotations

from dataclasses import dataclass

CONNECTOR_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
SCHED_OUTPUT = "vllm/v1/core/sched/output.py"
_MODELS = "vllm/model_executor/models/"
_PARALLEL = "vllm/distributed/parallel_state.py"

#: attention-module attributes the model adapter reads, per supported model family
ATTENTION_ATTRIBUTES = (
    "qkv_proj",
    "o_proj",
    "rotary_emb",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "scaling",
)
ATTENTION_CLASSES = (
    ("llama.py", "LlamaAttention"),
    ("qwen2.py", "Qwen2Attention"),
    ("qwen3.py", "Qwen3Attention"),
)


@dataclass(frozen=True)
class Symbol:
    """One vLLM symbol a code path uses.

    Attributes:
        path: source file inside the vLLM package (``vllm/...py``).
        qualname: ``Class``, ``Class.method``, ``function`` or ``Class.attribute``.
        kind: ``"class"``, ``"function"`` (``params`` must appear in this order, ``self``
            excluded) or ``"attribute"`` (assigned as ``self.<name>`` in the class or declared in
            its body; inherited ones are looked up through base classes of the same file).
        params: required leading parameter names of a function (for the CPU cache write:
            every name the call passes).
        why: what the integration uses it for.
    """

    path: str
    qualname: str
    kind: str
    params: tuple[str, ...] = ()
    why: str = ""


def _connector_methods() -> list[Symbol]:
    base = "KVConnectorBase_V1"
    methods = (
        ("register_kv_caches", ("kv_caches",)),
        ("start_load_kv", ("forward_context",)),
        ("wait_for_layer_load", ("layer_name",)),
        ("save_kv_layer", ("layer_name", "kv_layer", "attn_metadata")),
        ("wait_for_save", ()),
        ("get_finished", ("finished_req_ids",)),
        ("get_num_new_matched_tokens", ("request", "num_computed_tokens")),
        ("update_state_after_alloc", ("request", "blocks", "num_external_tokens")),
        ("build_connector_meta", ("scheduler_output",)),
        ("request_finished", ("request", "block_ids")),
    )
    return [
        Symbol(CONNECTOR_BASE, f"{base}.{name}", "function", params, "connector API")
        for name, params in methods
    ]


def common_symbols() -> list[Symbol]:
    """The symbols every supported release provides under the same name and signature."""
    symbols = [
        Symbol(CONNECTOR_BASE, "KVConnectorBase_V1", "class", why="connector base class"),
        Symbol(CONNECTOR_BASE, "KVConnectorMetadata", "class", why="metadata base"),
        Symbol(CONNECTOR_BASE, "KVConnectorRole", "class", why="scheduler/worker role"),
        *_connector_methods(),
        Symbol(SCHED_OUTPUT, "NewRequestData.req_id", "attribute"),
        Symbol(SCHED_OUTPUT, "NewRequestData.prompt_token_ids", "attribute"),
        Symbol(SCHED_OUTPUT, "NewRequestData.block_ids", "attribute"),
        Symbol(SCHED_OUTPUT, "NewRequestData.num_computed_tokens", "attribute"),
        Symbol(SCHED_OUTPUT, "CachedRequestData.req_ids", "attribute"),
        Symbol(SCHED_OUTPUT, "CachedRequestData.new_block_ids", "attribute"),
        Symbol(SCHED_OUTPUT, "CachedRequestData.num_computed_tokens", "attribute"),
        Symbol(SCHED_OUTPUT, "SchedulerOutput.scheduled_new_reqs", "attribute"),
        Symbol(SCHED_OUTPUT, "SchedulerOutput.scheduled_cached_reqs", "attribute"),
        Symbol(SCHED_OUTPUT, "SchedulerOutput.num_scheduled_tokens", "attribute"),
        Symbol("vllm/v1/request.py", "Request.prompt_token_ids", "attribute"),
        Symbol("vllm/v1/request.py", "Request.request_id", "attribute"),
        Symbol("vllm/v1/request.py", "Request.kv_transfer_params", "attribute"),
        Symbol("vllm/plugins/__init__.py", "load_general_plugins", "function"),
        Symbol(_PARALLEL, "get_tensor_model_parallel_rank", "function"),
        Symbol(_PARALLEL, "get_tensor_model_parallel_world_size", "function"),
        Symbol(_PARALLEL, "get_tp_group", "function"),
        Symbol(_MODELS + "qwen3.py", "Qwen3Attention.q_norm", "attribute"),
        Symbol(_MODELS + "qwen3.py", "Qwen3Attention.k_norm", "attribute"),
        Symbol(
            "vllm/v1/worker/gpu_model_runner.py",
            "GPUModelRunner.get_model",
            "function",
            why="the plugin unwraps the runner's model",
        ),
    ]
    for model_file, attn_cls in ATTENTION_CLASSES:
        for attr in ATTENTION_ATTRIBUTES:
            symbols.append(
                Symbol(_MODELS + model_file, f"{attn_cls}.{attr}", "attribute", why="model adapter")
            )
    return symbols
