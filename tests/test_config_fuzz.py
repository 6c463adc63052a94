"""Property-based tests of the settings, every scope of the registry: random YAML files,
environment values, ``extra_config`` and ``kv_connector_extra_config`` settings load, or fail with
a one-line :class:`ConfigError` naming a key that was given; random values of any single setting
parse or fail naming the setting, the value and what is accepted; random ``kv_transfer_params``
never raise; never another exception, and never a secret in a message.

Bounded: a fixed number of examples per test, no example database; ``CASES`` counts the cases
run (printed with ``-s``).
"""

from __future__ import annotations

import logging
import math
import string

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmcache_backend.config import CONFIG_FILE_ENV, CONFIG_KEYS, ConfigError, load_config
from lmcache_backend.settings import CONNECTOR, ENVIRONMENT, REGISTRY, REQUEST
from lmcache_backend.settings.setting import MAX_SHOWN
from lmcache_backend.storage.settings import EXTRA_DEFAULTS, store_settings

EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a case runs in ms; the first one also imports (seconds on a busy machine)
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
KEYS = [key.name for key in CONFIG_KEYS]
CASES: dict[str, int] = {}

#: strings that parsers have tripped on elsewhere: empty, null words, non-finite, huge, broken
SPECIAL = [
    "",
    "null",
    "none",
    "nan",
    "-inf",
    "inf",
    "-1",
    "0",
    "1e400",
    "[1,",
    "{}",
    "a,b",
    "\ud800",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308])
    | st.text(max_size=12)
    | st.sampled_from(SPECIAL)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)
extra_configs = st.dictionaries(st.sampled_from(sorted(EXTRA_DEFAULTS)), values, max_size=4)
names = st.sampled_from(KEYS) | st.text(
    alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12
)


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    """Random keys draw an "unknown key" warning each; thousands of them only slow the run."""
    log = logging.getLogger("lmcache_backend")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def _count(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


def _load(path=None, env=None, **overrides):
    """``load_config`` then the store's checks (as the connector does at start-up); a loaded
    configuration holds only usable numbers (a NaN capacity would fail later, in a tier)."""
    config = load_config(config_file=str(path) if path else None, env=env or {}, **overrides)
    store = store_settings(config)
    numbers = [config.max_local_cpu_size, config.max_local_disk_size]
    numbers += [config.blend_position_discount, *config.blend_recompute_ratios]
    numbers += [store.remote_timeout, store.max_local_device_size, store.remote_retry_max_delay]
    assert all(math.isfinite(n) for n in numbers), config
    return config


def _check_error(exc: ConfigError, given: set[str], secrets: list[str]) -> None:
    assert "\n" not in str(exc), f"not one line: {exc!r}"
    first = str(exc)
    named = {k for k in given if k in first}
    assert named, f"the error names none of {sorted(given)}: {exc}"
    for secret in secrets:
        if isinstance(secret, str) and len(secret) >= 4 and secret.strip():
            assert secret not in str(exc), "a secret was printed"


def _secrets(extra) -> list:
    """The shared secret, unless another key's value holds the same text (an error may show
    that value: it is not the secret's)."""
    if not isinstance(extra, dict):
        return []
    secret = extra.get("shared_secret")
    others = [str(v) for k, v in extra.items() if k != "shared_secret"]
    if isinstance(secret, str) and any(secret in other for other in others):
        return []
    return [secret]


@FUZZ
@given(data=st.dictionaries(names, values, max_size=6), extra=extra_configs | values)
def test_random_yaml_loads_or_names_the_key(tmp_path, data, extra) -> None:
    _count("yaml")
    data = {**data, "extra_config": extra}
    path = tmp_path / "lmcache.yaml"  # rewritten by every example
    try:
        path.write_text(yaml.safe_dump(data, allow_unicode=True))
    except (yaml.YAMLError, UnicodeEncodeError):
        return  # not representable as a YAML file
    try:
        _load(path)
    except ConfigError as exc:
        store_keys = {f"extra_config.{k}" for k in extra} if isinstance(extra, dict) else set()
        _check_error(exc, set(data) | store_keys | {CONFIG_FILE_ENV}, _secrets(extra))


@FUZZ
@given(text=st.text(max_size=200))
def test_random_yaml_text_loads_or_names_the_file(tmp_path, text) -> None:
    _count("yaml text")
    path = tmp_path / "lmcache.yaml"
    try:
        path.write_text(text, encoding="utf-8")
    except UnicodeEncodeError:
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        _load(path)
    except ConfigError as exc:
        given_keys = {CONFIG_FILE_ENV, *KEYS, *(f"extra_config.{k}" for k in EXTRA_DEFAULTS)}
        _check_error(exc, given_keys, [])


@FUZZ
@given(
    env=st.dictionaries(
        st.sampled_from(KEYS), st.text(max_size=24) | st.sampled_from(SPECIAL), max_size=6
    ),
    extra=st.none() | extra_configs.map(lambda d: yaml.safe_dump(d)) | st.text(max_size=40),
)
def test_random_environment_loads_or_names_the_variable(env, extra) -> None:
    _count("env")
    variables = {"LMCACHE_" + k.upper(): v for k, v in env.items()}
    if extra is not None:
        variables["LMCACHE_EXTRA_CONFIG"] = extra
    try:
        _load(env=variables)
    except ConfigError as exc:
        given_keys = set(env) | {"extra_config"} | {f"extra_config.{k}" for k in EXTRA_DEFAULTS}
        _check_error(exc, given_keys, [])


@FUZZ
@given(extra=extra_configs)
# another key's bad value equal to the secret: the error shows that value, not the secret
@example(extra={"segment_index": "0000", "copy_on_get": None, "shared_secret": "0000"})
def test_random_store_settings_load_or_name_the_key(extra) -> None:
    _count("extra_config")
    try:
        config = _load(extra_config=extra)
    except ConfigError as exc:
        _check_error(exc, {f"extra_config.{k}" for k in extra}, _secrets(extra))
        return
    parsed = store_settings(config)
    for name in ("remote_timeout", "remote_connect_timeout", "max_local_device_size"):
        assert math.isfinite(getattr(parsed, name))


@FUZZ
@given(
    own=st.dictionaries(
        st.sampled_from(sorted({*CONNECTOR, *(a for s in CONNECTOR.values() for a in s.aliases)})),
        values,
        max_size=4,
    ),
    extra=extra_configs,
)
def test_random_connector_settings_load_or_name_the_key(own, extra) -> None:
    """vLLM's ``kv_connector_extra_config``: the connector's own keys and the store's."""
    from types import SimpleNamespace

    from lmcache_backend.integration.vllm.settings import load_settings

    try:
        from lmcache_backend.data.embedded import embedded_model_path

        path = str(embedded_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    _count("connector")
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={**own, "extra_config": extra}, engine_id="fuzz"
        ),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(num_hidden_layers=30),
            tokenizer=path,
            tokenizer_revision=None,
            trust_remote_code=False,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    try:
        settings = load_settings(vllm_config)
    except ConfigError as exc:
        renamed = {s.name for s in CONNECTOR.values() if set(s.aliases) & set(own)}
        given = set(own) | renamed | {f"extra_config.{k}" for k in extra}
        _check_error(exc, given, _secrets(extra))
        return
    from lmcache_backend.storage.lookup.index_dir import default_index_dir

    default_index_dir(settings.instance_id)  # what the store will name its folder with


@FUZZ
@given(
    setting=st.sampled_from(REGISTRY),
    value=values | st.sampled_from(["yes", "off", "auto", "AUTO", " 3 ", "0.5", "1,2", "[1, 2]"]),
)
def test_any_value_of_any_setting_parses_or_names_key_value_and_what_is_accepted(
    setting, value
) -> None:
    """Every setting of every scope: a value parses (and the result parses to itself, so a
    value checked again is unchanged) or fails in one line naming the setting, the value and
    what the setting accepts."""
    _count("any setting")
    try:
        parsed = setting.value(value, "fuzz")
    except ConfigError as exc:
        line = str(exc)
        assert "\n" not in line and len(line) < 2 * MAX_SHOWN + 400, line
        assert line.startswith(f"{setting.label} (from fuzz) = "), line
        if not setting.secret:
            assert setting.shown(value) in line
        return
    assert setting.value(parsed, "again") == parsed


@FUZZ
@given(
    params=st.none()
    | values
    | st.dictionaries(
        st.sampled_from([*REQUEST, "blend_ratio", "blendx", "other_connector"]), values, max_size=4
    )
)
def test_random_kv_transfer_params_never_raise(params, caplog) -> None:
    """A request's ``kv_transfer_params`` come from clients unchecked: whatever they hold, the
    request gets the engine's settings, its own, or none (opted out), and every warning is one
    line."""
    from lmcache_backend.integration.vllm.settings import request_config

    _count("request")
    engine = load_config(env={}, enable_blending=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmcache_backend"):
        out = request_config(engine, params, num_layers=30, request_id="fuzz")
    assert out is None or type(out) is type(engine)
    if out is None:
        assert isinstance(params, dict) and "blend" in params
    for record in caplog.records:
        assert "\n" not in record.getMessage()


@FUZZ
@given(
    name=st.sampled_from(sorted(ENVIRONMENT)),
    raw=st.text(max_size=24) | st.sampled_from(SPECIAL),
)
def test_random_environment_only_variables_read_or_name_the_variable(name, raw) -> None:
    from lmcache_backend.settings import read_variable

    _count("environment only")
    if "\0" in raw:
        return  # no process environment holds a NUL
    try:
        read_variable(name, {name: raw})
    except ConfigError as exc:
        _check_error(exc, {name}, [])


def test_fuzz_cases_ran() -> None:
    """Runs after the fuzz tests of this module (pytest keeps file order): every one ran its
    examples."""
    print(f"\nconfig fuzz cases: {CASES}")
    if len(CASES) < 8:
        pytest.skip("run with the whole module to count its cases")
    assert all(n >= EXAMPLES // 2 for n in CASES.values()), CASES
