"""Configuration: sources, precedence, parsing and every validation error."""

from __future__ import annotations

import logging

import pytest

from lmcache_backend.config import CONFIG_KEYS, BlendConfig, ConfigError, load_config


def test_defaults() -> None:
    """LMCache's keys keep LMCache's values; the selection and ratio, which LMCache leaves unset,
    are the measured best trade-off within 25% of token-layers (docs/quality.md)."""
    config = load_config(env={})
    assert config.enable_blending is False
    assert config.blend_special_str == " # # "
    assert config.blend_min_tokens == 256
    assert config.blend_check_layers == [1]
    assert config.blend_recompute_ratios == [0.2]
    assert config.blend_selection == "query_preview_last"
    assert config.backend == "auto"


def test_lmcache_selection_is_one_key_away() -> None:
    config = load_config(
        env={
            "LMCACHE_BLEND_SELECTION": "kv_deviation",
            "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15",
            "LMCACHE_BLEND_CHECK_LAYERS": "1",
        }
    )
    assert config.blend_selection == "kv_deviation"
    assert config.check_schedule() == [(1, 0.15)]


def test_every_key_has_env_name_and_description() -> None:
    for key in CONFIG_KEYS:
        assert key.env == "LMCACHE_" + key.name.upper()
        assert key.description


def test_yaml_file(tmp_path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(
        "enable_blending: true\nblend_special_str: ' ## '\nblend_min_tokens: 128\n"
        "blend_check_layers: [1, 2]\nblend_recompute_ratios: [0.3, 0.15]\n"
    )
    config = load_config(env={"LMCACHE_CONFIG_FILE": str(path)})
    assert config.enable_blending is True
    assert config.blend_special_str == " ## "
    assert config.blend_min_tokens == 128
    assert config.check_schedule() == [(1, 0.3), (2, 0.15)]
    assert config.sources["blend_min_tokens"] == str(path)


@pytest.mark.parametrize(
    "raw, expected",
    [("0.15", [0.15]), ("0.1,0.2", [0.1, 0.2]), ("[0.1, 0.2]", [0.1, 0.2]), (" 1 ", [1.0])],
)
def test_env_ratio_lists(raw: str, expected: list[float]) -> None:
    config = load_config(
        env={"LMCACHE_BLEND_RECOMPUTE_RATIOS": raw, "LMCACHE_BLEND_CHECK_LAYERS": "1,2"}
    )
    assert config.blend_recompute_ratios == expected


@pytest.mark.parametrize(
    "raw, expected", [("true", True), ("1", True), ("False", False), ("0", False)]
)
def test_env_booleans(raw: str, expected: bool) -> None:
    assert load_config(env={"LMCACHE_ENABLE_BLENDING": raw}).enable_blending is expected


def test_precedence_kwargs_over_env_over_file_over_default(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("blend_min_tokens: 10\nblend_special_str: ' @@ '\nbackend: torch\n")
    env = {
        "LMCACHE_CONFIG_FILE": str(path),
        "LMCACHE_BLEND_MIN_TOKENS": "20",
        "LMCACHE_BLEND_SPECIAL_STR": " %% ",
    }
    config = load_config(env=env, blend_min_tokens=30)
    assert config.blend_min_tokens == 30  # argument beats env and file
    assert config.blend_special_str == " %% "  # env beats file
    assert config.backend == "torch"  # file beats default
    assert config.enable_blending is False  # default
    assert config.sources["blend_min_tokens"] == "argument"
    assert config.sources["blend_special_str"] == "LMCACHE_BLEND_SPECIAL_STR"
    # None arguments do not override (vLLM passes unset extra-config keys that way)
    assert load_config(env=env, blend_min_tokens=None).blend_min_tokens == 20


def test_config_file_argument_beats_env_file(tmp_path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("blend_min_tokens: 1\n")
    b.write_text("blend_min_tokens: 2\n")
    config = load_config(config_file=str(b), env={"LMCACHE_CONFIG_FILE": str(a)})
    assert config.blend_min_tokens == 2


@pytest.mark.parametrize(
    "settings, key, fragment",
    [
        ({"blend_recompute_ratios": "1.5"}, "blend_recompute_ratios", "1.5"),
        ({"blend_recompute_ratios": "-0.1"}, "blend_recompute_ratios", "-0.1"),
        (
            {"blend_recompute_ratios": "0.1,0.2,0.3", "blend_check_layers": "1,2"},
            "blend_recompute_ratios",
            "one per check layer",
        ),
        ({"blend_min_tokens": "-1"}, "blend_min_tokens", "-1"),
        ({"blend_block_size": "0"}, "blend_block_size", "0"),
        ({"blend_check_layers": "2,1"}, "blend_check_layers", "increasing"),
        ({"blend_check_layers": "-1"}, "blend_check_layers", "-1"),
        ({"backend": "tpu"}, "backend", "tpu"),
        ({"enable_blending": "maybe"}, "enable_blending", "maybe"),
        ({"blend_min_tokens": "many"}, "blend_min_tokens", "many"),
        ({"blend_check_layers": "1.5"}, "blend_check_layers", "1.5"),
        ({"blend_position_discount": "-1"}, "blend_position_discount", "-1"),
        ({"blend_position_discount": "nan"}, "blend_position_discount", "nan"),
        ({"blend_position_discount": "inf"}, "blend_position_discount", "inf"),
        ({"blend_position_discount": "late"}, "blend_position_discount", "late"),
        ({"blend_selection_span": "0"}, "blend_selection_span", "0"),
        ({"blend_selection_span": "wide"}, "blend_selection_span", "wide"),
        ({"blend_chunk_head_tokens": "-1"}, "blend_chunk_head_tokens", "-1"),
        ({"blend_preview_scored_layers": "local"}, "blend_preview_scored_layers", "local"),
        ({"blend_preview_scored_from": "1"}, "blend_preview_scored_from", "1"),
        ({"blend_preview_scored_from": "nan"}, "blend_preview_scored_from", "nan"),
    ],
)
def test_validation_errors_name_key_and_value(settings: dict, key: str, fragment: str) -> None:
    env = {"LMCACHE_" + k.upper(): v for k, v in settings.items()}
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    message = str(err.value)
    assert message.startswith(key), message
    assert fragment in message, message
    assert "LMCACHE_" in message  # where the value came from


def test_check_layer_beyond_model() -> None:
    config = load_config(env={}, blend_check_layers=[1, 30])
    config.validate_for_model(31)
    with pytest.raises(
        ConfigError, match=r"blend_check_layers .* layer 30 does not exist.*30 layers"
    ):
        config.validate_for_model(30)


def test_unknown_key_warns_with_closest(caplog, tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("blend_recompute_ratio: 0.2\n")
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.config"):
        config = load_config(env={"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_ENABLE_BLEND": "1"})
    text = caplog.text
    assert "'blend_recompute_ratio'" in text and "did you mean 'blend_recompute_ratios'" in text
    assert "'enable_blend'" in text and "did you mean 'enable_blending'" in text
    assert config.blend_recompute_ratios == [0.2]  # the unknown key changed nothing


def test_lmcache_keys_we_do_not_use_load_quietly(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_backend.config"):
        load_config(env={"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_USE_LAYERWISE": "True"})
    assert caplog.text == ""


def test_one_ratio_broadcasts() -> None:
    config = load_config(env={}, blend_check_layers=[1, 3, 5], blend_recompute_ratios=[0.2])
    assert config.check_schedule() == [(1, 0.2), (3, 0.2), (5, 0.2)]


def test_ratio_zero_and_one_are_valid() -> None:
    assert load_config(env={}, blend_recompute_ratios=0).blend_recompute_ratios == [0.0]
    assert load_config(env={}, blend_recompute_ratios=1).blend_recompute_ratios == [1.0]


def test_replace_validates() -> None:
    config = load_config(env={})
    assert config.replace(blend_recompute_ratios=[0.3]).blend_recompute_ratios == [0.3]
    with pytest.raises(ConfigError, match="blend_recompute_ratios"):
        config.replace(blend_recompute_ratios=[2.0])


def test_missing_and_malformed_yaml(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(env={"LMCACHE_CONFIG_FILE": str(tmp_path / "nope.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(env={"LMCACHE_CONFIG_FILE": str(bad)})


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError, match="blend_min_tokens"):
        BlendConfig(blend_min_tokens=-5)
