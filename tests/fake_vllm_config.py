"""The parts of vLLM's ``VllmConfig`` the connector's settings read, for scheduler-side tests
that need no engine."""

from __future__ import annotations

from types import SimpleNamespace


def vllm_config(path: str, extra: dict, num_layers: int = 30) -> SimpleNamespace:
    """A config for the model (tokenizer) at ``path`` with ``extra`` as the connector's
    ``kv_connector_extra_config``, ``num_layers`` layers and one tensor-parallel rank."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, engine_id="t"),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(num_hidden_layers=num_layers),
            tokenizer=path,
            tokenizer_revision=None,
            trust_remote_code=False,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
