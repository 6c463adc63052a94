"""What the vLLM adapter refuses at start-up, on stand-in modules shaped like vLLM's (no
engine): one line naming the layer and what is not reproduced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from lmcache_backend.models.base import UnsupportedModelError  # noqa: E402
from lmcache_backend.models.vllm_layers import check_layers  # noqa: E402

_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "mlp",
)


def _layer(attn_type: str = "decoder", soft_cap=None, norms=_NORMS) -> SimpleNamespace:
    attn = SimpleNamespace(attn_type=attn_type, impl=SimpleNamespace(logits_soft_cap=soft_cap))
    return SimpleNamespace(
        self_attn=SimpleNamespace(attn=attn), **{n: torch.nn.Identity() for n in norms}
    )


def _config(layer_types=("sliding_attention", "full_attention")) -> SimpleNamespace:
    return SimpleNamespace(layer_types=list(layer_types))


def test_gemma3_layers_are_accepted() -> None:
    check_layers("Gemma3ForCausalLM", [_layer(), _layer()], _config())


@pytest.mark.parametrize(
    "layers, config, problem",
    [
        ([_layer(), _layer()], _config(("sliding_attention", "chunked_attention")), "layer 1"),
        ([_layer(), _layer(attn_type="encoder_only")], _config(), "not causal"),
        ([_layer(soft_cap=50.0), _layer()], _config(), "softcapping"),
        ([_layer(norms=_NORMS[:2] + ("mlp",)), _layer()], _config(), "pre_feedforward"),
    ],
    ids=["layer-kind", "bidirectional", "softcap", "norm-layout"],
)
def test_unreproduced_layers_are_refused_in_one_line(layers, config, problem) -> None:
    with pytest.raises(UnsupportedModelError, match=problem) as info:
        check_layers("Gemma3ForCausalLM", layers, config)
    message = str(info.value)
    assert "\n" not in message and "Gemma3ForCausalLM" in message, message
    assert "without the CacheBlend connector" in message


def test_llama_layout_needs_no_feed_forward_norms() -> None:
    llama = _layer(norms=("input_layernorm", "post_attention_layernorm", "mlp"))
    check_layers("LlamaForCausalLM", [llama], SimpleNamespace())
