"""The LMCache glue's logic on CPU, against a stand-in ``lmcache`` package (defined below).

Covers version selection and refusals, install / uninstall / idempotence, the plugin path, the
doctor section, and one blended request through the stand-in's LMCache-shaped layer loop with a
tiny Llama-like model: when the cached K/V equal what a full prefill computes (cached at other
positions), the blended K/V and output must equal the full prefill's for any recompute ratio.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from lmcache_backend.compat import UnsupportedVersions, Versions
from lmcache_backend.compat.lmcache import family_for
from lmcache_backend.integration import lmcache as interop
from lmcache_backend.integration.lmcache import glue, hooks
from lmcache_backend.integration.lmcache import installer as install
from lmcache_backend.models.base import rope_cos_sin_cache
from lmcache_backend.ops.reference import apply_rope, rope_rerotate_k

ENGINE = "vllm-instance"

# -- the stand-in ``lmcache`` package (NOT LMCache) --------------------------------------------
# The module layout and the few objects the glue touches, as LMCache 0.3.12 arranges them, with
# a CPU layerwise loop shaped like LMCache's (``LMCBaseModel.compute_layer`` and the layerwise GPU
# connector's buffer protocol: layer i is in the buffer before layer i is computed and goes to the
# paged cache two steps later).

FILES = {
    "lmcache/__init__.py": '"""Stand-in for LMCache (tests only)."""\n',
    "lmcache/v1/__init__.py": "",
    "lmcache/v1/compute/__init__.py": "",
    "lmcache/v1/compute/blend/__init__.py": "",
    "lmcache/v1/compute/blend/blender.py": "class LMCBlender:\n    pass\n",
    "lmcache/v1/compute/blend/utils.py": """
from lmcache.v1.compute.blend.blender import LMCBlender
from lmcache.v1.compute.models.utils import VLLMModelTracker


class LMCBlenderBuilder:
    _blenders = {}

    @classmethod
    def get_or_create(cls, instance_id, cache_engine, gpu_connector, config):
        if instance_id not in cls._blenders:
            cls._blenders[instance_id] = LMCBlender()
        return cls._blenders[instance_id]

    @classmethod
    def get(cls, instance_id):
        return cls._blenders[instance_id]
""",
    "lmcache/v1/compute/positional_encoding.py": """
def get_fused_rope(head_size, rotary_dim, max_position, base, is_neox_style=True,
                   rope_scaling=None, dtype=None, partial_rotary_factor=1.0):
    raise RuntimeError("stand-in: LMCache's CUDA rope kernel is not available")
""",
    "lmcache/v1/compute/attention/__init__.py": "",
    "lmcache/v1/compute/attention/utils.py": """
def infer_attn_backend_from_vllm(vllm_attn, enable_sparse=False):
    raise ValueError("stand-in: flash-attention backend is not available")
""",
    "lmcache/v1/compute/models/__init__.py": "",
    "lmcache/v1/compute/models/utils.py": """
class VLLMModelTracker:
    _vllm_models = {}

    @classmethod
    def register_model(cls, instance_id, vllm_model):
        cls._vllm_models.setdefault(instance_id, vllm_model)

    @classmethod
    def get_model(cls, instance_id):
        return cls._vllm_models[instance_id]


def infer_model_from_vllm(vllm_model, blender, enable_sparse=False):
    from lmcache.v1.compute.models.base import LMCBaseModel

    return LMCBaseModel(vllm_model, blender, enable_sparse)
""",
    "lmcache/v1/compute/models/base.py": '''
from lmcache.v1.compute.attention.utils import infer_attn_backend_from_vllm
from lmcache.v1.compute.positional_encoding import get_fused_rope


class LMCBaseModel:
    """LMCache's layer loop: process_qkv, then the attention backend, then o_proj and MLP."""

    def __init__(self, vllm_model, blender, enable_sparse=False):
        self.vllm_model = vllm_model
        self.blender = blender
        layers = vllm_model.model.layers
        self.vllm_attn_layers = [layer.self_attn.attn for layer in layers]
        self.lmc_attn_layers = [
            infer_attn_backend_from_vllm(a, enable_sparse) for a in self.vllm_attn_layers
        ]
        rope = layers[0].self_attn.rotary_emb
        self.fused_rotary_emb = get_fused_rope(
            rope.head_size, rotary_dim=rope.head_size, max_position=rope.max_position_embeddings,
            base=rope.base, rope_scaling=None, is_neox_style=rope.is_neox_style, dtype=None)
        self.last_hidden = None

    def compute_layer(self, input_ids):
        hidden_states = self.vllm_model.get_input_embeddings(input_ids)
        residual = None
        attn_output = None
        attn_metadata = self.lmc_attn_layers[0].init_attn_metadata(input_ids=input_ids)
        for idx, layer in enumerate(self.vllm_model.model.layers):
            if residual is None:
                residual = hidden_states
                hidden_states = layer.input_layernorm(hidden_states)
            else:
                hidden_states, residual = layer.input_layernorm(hidden_states, residual)
            qkv, _ = layer.self_attn.qkv_proj(hidden_states)
            q, k, v = qkv.split(
                [layer.self_attn.q_size, layer.self_attn.kv_size, layer.self_attn.kv_size], dim=-1)
            q, k, v, residual, attn_output, attn_metadata = self.blender.process_qkv(
                q, k, v, residual, idx, attn_output, attn_metadata)
            a = self.vllm_attn_layers[idx]
            q = q.view(-1, a.num_heads, a.head_size)
            k = k.view(-1, a.num_kv_heads, a.head_size)
            v = v.view(-1, a.num_kv_heads, a.head_size)
            attn_output = attn_output.view(-1, a.num_heads, a.head_size)
            attn_output = self.lmc_attn_layers[idx].forward_contiguous(
                q, k, v, attn_output, attn_metadata)
            attn_output = attn_output.view(-1, a.num_heads * a.head_size)
            hidden_states, _ = layer.self_attn.o_proj(attn_output)
            hidden_states, residual = layer.post_attention_layernorm(hidden_states, residual)
            hidden_states = layer.mlp(hidden_states)
            self.last_hidden = hidden_states + residual
            yield
''',
    "lmcache/v1/gpu_connector.py": '''
class VLLMBufferLayerwiseGPUConnector:
    """Holds one re-rotated layer of cached K/V per computed layer (CPU here)."""

    def __init__(self):
        self.buffer_mapping = {}
        self.current_gap_positions = None
        self.paged = {}

    def get_kv(self, layer_id):
        return self.buffer_mapping[layer_id]
''',
    "lmcache/v1/cache_engine.py": '''
import torch

from lmcache.v1.compute.blend.utils import LMCBlenderBuilder


class LMCacheEngine:
    """``store[layer] = (k [T, Hkv*D], v, old_positions [T])``; rows in ``gaps`` are absent."""

    def __init__(self, config, gpu_connector, store, gaps, num_layers, instance_id):
        self.config = config
        self.gpu_connector = gpu_connector
        self.store = store
        self.gaps = gaps
        self.num_layers = num_layers
        self.instance_id = instance_id

    def _load(self, layer_id, num_tokens):
        k, v, old = (t.clone() for t in self.store[layer_id])
        rope = LMCBlenderBuilder.get(self.instance_id).layerwise_model.fused_rotary_emb
        k = rope(old, torch.arange(num_tokens), k)
        k[self.gaps] = 0.0
        v[self.gaps] = 0.0
        self.gpu_connector.buffer_mapping[layer_id] = (k, v)

    def retrieve_layer(self, tokens, mask=None, **kwargs):
        """Yields num_layers + 2 times; layer i is in the buffer before layer i is computed and
        goes to the paged cache two steps later, as LMCache's connector does."""
        conn, n = self.gpu_connector, len(tokens)
        conn.current_gap_positions = self.gaps
        for step in range(self.num_layers + 2):
            if step > 1:
                conn.paged[step - 2] = conn.buffer_mapping.pop(step - 2)
            if step < self.num_layers:
                self._load(step, n)
            yield
''',
    "lmcache/integration/__init__.py": "",
    "lmcache/integration/vllm/__init__.py": "",
    "lmcache/integration/vllm/utils.py": 'ENGINE_NAME = "vllm-instance"\n',
}


def write_standin(root: Path) -> Path:
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip("\n"), encoding="utf-8")
    return root


def _versions(vllm, lmcache):
    return Versions(vllm=vllm, vllm_ascend=None, lmcache=lmcache, torch=None)


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The stand-in importable as ``lmcache`` (0.3.12 layout), reported as version 0.3.12."""
    write_standin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(install, "_versions", lambda: _versions("0.11.0", "0.3.12"))
    for key in ("LMCACHE_CONFIG_FILE", "LMCACHE_EXTRA_CONFIG", glue.FORCE_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LMCACHE_BACKEND", "torch")
    yield tmp_path
    install.uninstall()
    for name in [m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")]:
        sys.modules.pop(name, None)


# -- version selection ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version,forced,expected",
    [
        ("0.3.3", False, "0.3.3"),
        ("0.3.7", False, "0.3.7"),
        ("0.3.12", False, "0.3.12"),
        ("0.3.12.post1", False, "0.3.12"),
        ("0.3.5", False, None),
        ("0.3.5", True, "0.3.3"),
        ("0.3.9", True, "0.3.7"),
        ("0.4.0", True, "0.3.12"),
        ("0.3.1", True, None),
    ],
)
def test_family_for(version, forced, expected):
    family = family_for(version, forced=forced)
    assert (family.name if family else None) == expected


def test_install_without_lmcache_refuses(monkeypatch):
    monkeypatch.setattr(install, "_versions", lambda: _versions("0.11.0", None))
    with pytest.raises(UnsupportedVersions, match="not installed"):
        install.install()


@pytest.mark.parametrize(
    "vllm,lmcache,match",
    [
        ("0.9.2", "0.3.12", "conflict"),
        ("0.10.0", "0.3.7", "unsupported"),
        ("0.11.0", "0.3.9", "not in the CacheBlend version matrix"),
    ],
)
def test_refused_combinations_name_the_row(standin, monkeypatch, vllm, lmcache, match):
    monkeypatch.setattr(install, "_versions", lambda: _versions(vllm, lmcache))
    with pytest.raises(UnsupportedVersions, match=match) as err:
        install.install()
    assert "Supported:" in str(err.value)
    assert not install.is_installed()


def test_conflict_is_refused_even_when_forced(standin, monkeypatch):
    monkeypatch.setattr(install, "_versions", lambda: _versions("0.9.2", "0.3.12"))
    with pytest.raises(UnsupportedVersions, match="conflict"):
        install.install(force=True)


def test_wrong_glue_for_the_installed_layout_changes_nothing(standin, monkeypatch):
    """Reported as 0.3.7 (models.llama hooks) on a 0.3.12-shaped package: refused, untouched."""
    from lmcache.v1.compute.blend.utils import LMCBlenderBuilder

    before = vars(LMCBlenderBuilder)["get_or_create"]
    monkeypatch.setattr(install, "_versions", lambda: _versions("0.9.2", "0.3.7"))
    with pytest.raises(install.IncompatibleLMCache, match="lmcache.v1.compute.models.llama"):
        install.install()
    assert vars(LMCBlenderBuilder)["get_or_create"] is before
    assert not install.is_installed()


# -- install / uninstall ---------------------------------------------------------------------------


def test_install_replaces_and_uninstall_restores(standin):
    import lmcache.v1.compute.models.base as base
    from lmcache.v1.compute.blend.utils import LMCBlenderBuilder

    originals = (
        vars(LMCBlenderBuilder)["get_or_create"],
        base.get_fused_rope,
        base.infer_attn_backend_from_vllm,
    )
    result = install.install()
    assert result.installed and not result.already and result.family == "0.3.12"
    assert result.row is not None and result.row.lmcache == "0.3.12" and not result.forced
    assert len(result.patched) == 3
    assert install.is_installed()
    assert vars(LMCBlenderBuilder)["get_or_create"] is not originals[0]
    assert base.get_fused_rope is not originals[1]
    assert isinstance(base.infer_attn_backend_from_vllm(_attn()), hooks.ExactMaskAttention)

    again = install.install()
    assert again.already and again.patched == result.patched
    assert vars(LMCBlenderBuilder)["get_or_create"] is vars(LMCBlenderBuilder)["get_or_create"]

    assert install.uninstall() is True
    assert not install.is_installed()
    assert (
        vars(LMCBlenderBuilder)["get_or_create"],
        base.get_fused_rope,
        base.infer_attn_backend_from_vllm,
    ) == originals
    assert install.uninstall() is False


def test_is_installed_notices_a_binding_replaced_by_someone_else(standin):
    import lmcache.v1.compute.models.base as base

    install.install()
    base.get_fused_rope = lambda *a, **k: None
    assert not install.is_installed()
    result = install.install()  # re-applies instead of reporting "already"
    assert not result.already and install.is_installed()


def test_forced_unlisted_release_uses_the_covering_glue(standin, monkeypatch):
    monkeypatch.setattr(install, "_versions", lambda: _versions("0.11.0", "0.3.13"))
    result = install.install(force=True)
    assert result.installed and result.forced and result.family == "0.3.12" and result.row is None


# -- plugin path --------------------------------------------------------------------------------


def test_plugin_does_nothing_without_lmcache(monkeypatch):
    monkeypatch.setattr(install, "lmcache_importable", lambda: False)
    monkeypatch.setattr(install, "install", lambda force=False: pytest.fail("must not install"))
    result = install.maybe_install_from_plugin()
    assert not result.installed and "not installed" in result.reason


def test_plugin_does_nothing_with_blending_off(standin, monkeypatch):
    monkeypatch.setenv("LMCACHE_ENABLE_BLENDING", "false")
    result = install.maybe_install_from_plugin()
    assert not result.installed and "enable_blending" in result.reason
    assert not install.is_installed()


def test_plugin_installs_with_blending_on(standin, monkeypatch):
    monkeypatch.setenv("LMCACHE_ENABLE_BLENDING", "true")
    result = install.maybe_install_from_plugin()
    assert result.installed and install.is_installed()


@pytest.mark.parametrize("how", ["env", "extra_config"])
def test_plugin_fails_loudly_outside_the_matrix_unless_forced(standin, monkeypatch, how):
    monkeypatch.setenv("LMCACHE_ENABLE_BLENDING", "true")
    monkeypatch.setattr(install, "_versions", lambda: _versions("0.11.0", "0.3.13"))
    with pytest.raises(UnsupportedVersions, match="not in the CacheBlend version matrix"):
        install.maybe_install_from_plugin()
    if how == "env":
        monkeypatch.setenv(glue.FORCE_ENV, "1")
    else:
        monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps({install.FORCE_EXTRA_KEY: True}))
    assert install.maybe_install_from_plugin().forced


def test_force_env_with_a_bad_value_is_an_error(monkeypatch):
    monkeypatch.setenv(glue.FORCE_ENV, "maybe")
    with pytest.raises(UnsupportedVersions, match=glue.FORCE_ENV):
        install.force_requested()


# -- doctor ---------------------------------------------------------------------------------------


def test_doctor_section(standin):
    title, rows = interop.doctor_section()
    values = dict(rows)
    assert title == "lmcache"
    assert values["lmcache"] == "0.3.12" and values["glue"] == "0.3.12"
    assert "stable" in values["matrix row"] and values["interop active"] == "no"
    install.install()
    assert dict(interop.doctor_section()[1])["interop active"].startswith("yes: 0.3.12")


def test_doctor_section_without_lmcache(monkeypatch):
    monkeypatch.setattr(install, "_versions", lambda: _versions("0.11.0", None))
    values = dict(interop.doctor_section()[1])
    assert values["lmcache"] == "not installed" and values["interop active"] == "no"


# -- one blended request through the stand-in's layer loop ---------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD, LAYERS, VOCAB = 32, 4, 2, 8, 3, 50


def _attn():
    return types.SimpleNamespace(
        impl=types.SimpleNamespace(
            scale=HEAD**-0.5, alibi_slopes=None, sliding_window=None, logits_soft_cap=None
        ),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
    )


class _Rope:
    head_size, max_position_embeddings, base, is_neox_style = HEAD, 256, 10000.0, True

    def __init__(self):
        inv = 1.0 / (self.base ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD))
        self.table = rope_cos_sin_cache(inv, self.max_position_embeddings)

    def __call__(self, positions, q, k):
        q = apply_rope(q.reshape(q.shape[0], -1, HEAD), positions, self.table, True)
        k = apply_rope(k.reshape(k.shape[0], -1, HEAD), positions, self.table, True)
        return q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)


class _Norm(torch.nn.Module):
    def forward(self, x, residual=None):
        if residual is None:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],))
        residual = x + residual
        return torch.nn.functional.rms_norm(residual, (x.shape[-1],)), residual


class _Linear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x), None


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        attn = types.SimpleNamespace(
            qkv_proj=_Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD, bias=False),
            o_proj=_Linear(HEADS * HEAD, HIDDEN, bias=False),
            q_size=HEADS * HEAD,
            kv_size=KV_HEADS * HEAD,
            rotary_emb=_Rope(),
            attn=_attn(),
        )
        layers.append(
            types.SimpleNamespace(
                self_attn=attn,
                input_layernorm=_Norm(),
                post_attention_layernorm=_Norm(),
                mlp=torch.nn.Sequential(
                    torch.nn.Linear(HIDDEN, 64), torch.nn.SiLU(), torch.nn.Linear(64, HIDDEN)
                ),
            )
        )
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    return types.SimpleNamespace(
        model=types.SimpleNamespace(layers=layers), get_input_embeddings=embed
    )


@torch.no_grad()
def _full_prefill(model, tokens, positions):
    """Plain causal prefill: per layer (k [T, Hkv*D], v) and the last hidden state."""
    h, residual, kv = model.get_input_embeddings(tokens), None, []
    for layer in model.model.layers:
        if residual is None:
            residual, h = h, layer.input_layernorm(h)
        else:
            h, residual = layer.input_layernorm(h, residual)
        qkv, _ = layer.self_attn.qkv_proj(h)
        q, k, v = qkv.split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        q, k = layer.self_attn.rotary_emb(positions, q, k)
        kv.append((k.clone(), v.clone()))
        qh = q.view(-1, HEADS, HEAD).transpose(0, 1)
        kh = k.view(-1, KV_HEADS, HEAD).repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        vh = v.view(-1, KV_HEADS, HEAD).repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        h, _ = layer.self_attn.o_proj(o.transpose(0, 1).reshape(-1, HEADS * HEAD))
        h, residual = layer.post_attention_layernorm(h, residual)
        h = layer.mlp(h)
    return kv, (h + residual)[-1]


def _blend(standin, monkeypatch, ratio, cached_noise=0.0):
    monkeypatch.setenv("LMCACHE_ENABLE_BLENDING", "true")
    monkeypatch.setenv("LMCACHE_BLEND_MIN_TOKENS", "0")
    install.install()
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.compute.blend.utils import LMCBlenderBuilder
    from lmcache.v1.compute.models.utils import VLLMModelTracker
    from lmcache.v1.gpu_connector import VLLMBufferLayerwiseGPUConnector

    model = _model()
    tokens = torch.randint(0, VOCAB, (40,))
    positions = torch.arange(40)
    reference, last_hidden = _full_prefill(model, tokens, positions)
    # The cache holds the same K/V computed 7 positions further on; rows 10..13 are uncached.
    old = positions + 7
    store = {}
    for i, (k, v) in enumerate(reference):
        moved = k.clone().view(40, KV_HEADS, HEAD)
        rope_rerotate_k(moved, positions, old, _Rope().table, True)
        moved = moved.reshape(40, -1)
        store[i] = (moved + cached_noise * torch.randn_like(moved), v.clone(), old)
    gaps = torch.arange(10, 14)
    config = types.SimpleNamespace(
        blend_check_layers=[1], blend_recompute_ratios=[ratio], blend_min_tokens=0, extra_config={}
    )
    VLLMModelTracker.register_model(ENGINE, model)
    conn = VLLMBufferLayerwiseGPUConnector()
    engine = LMCacheEngine(config, conn, store, gaps, LAYERS, ENGINE)
    blender = LMCBlenderBuilder.get_or_create(ENGINE, engine, conn, config)
    assert isinstance(blender, glue.LMCacheBlender)
    assert LMCBlenderBuilder.get_or_create(ENGINE, engine, conn, config) is blender
    with torch.no_grad():
        blender.blend(tokens, None, kvcaches=None, slot_mapping=None)
    return blender, conn, reference, last_hidden


@pytest.mark.parametrize("ratio", [0.0, 0.25, 1.0])
def test_blend_equals_full_prefill_when_the_cache_is_exact(standin, monkeypatch, ratio):
    blender, conn, reference, last_hidden = _blend(standin, monkeypatch, ratio)
    assert sorted(conn.paged) == list(range(LAYERS))
    for layer, (k, v) in enumerate(reference):
        torch.testing.assert_close(conn.paged[layer][0], k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conn.paged[layer][1], v, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        blender.layerwise_model.last_hidden[-1], last_hidden, rtol=1e-4, atol=1e-4
    )
    assert blender.state is None  # cleaned up after the request
    rows = blender.layerwise_model.last_hidden.shape[0]
    assert rows == (40 if ratio == 1.0 else 4 + max(int(ratio * 36), 0) + 1)


def test_blend_with_a_wrong_cache_differs(standin, monkeypatch):
    """The comparison above can fail: a perturbed cache with ratio 0 leaves a visible error."""
    blender, conn, reference, _ = _blend(standin, monkeypatch, 0.0, cached_noise=0.5)
    assert not torch.allclose(conn.paged[LAYERS - 1][0], reference[LAYERS - 1][0], atol=1e-2)
    # Uncached rows and the last token are always recomputed, so they stay exact.
    torch.testing.assert_close(
        conn.paged[1][0][10:14], reference[1][0][10:14], rtol=1e-4, atol=1e-4
    )


def test_uninstall_forgets_the_blenders(standin, monkeypatch):
    _blend(standin, monkeypatch, 0.25)
    from lmcache.v1.compute.blend.utils import LMCBlenderBuilder

    assert ENGINE in LMCBlenderBuilder._blenders
    install.uninstall()
    assert ENGINE not in LMCBlenderBuilder._blenders
