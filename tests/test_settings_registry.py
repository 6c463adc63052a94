"""The settings registry: every key declared once, and everything that follows from it (the
objects holding the values, booleans read alike in every scope, no "unknown key" for a declared
variable, the docs' tables, no setting read from the environment anywhere else)."""

from __future__ import annotations

import ast
import logging
import re
from dataclasses import fields

import pytest
from repo_paths import REPO_ROOT

from lmcache_backend.config import BlendConfig, ConfigError, load_config
from lmcache_backend.settings import (
    CONNECTOR,
    ENGINE,
    ENVIRONMENT,
    REGISTRY,
    REQUEST,
    STORE,
    read_variable,
)
from lmcache_backend.settings import parsers as p
from lmcache_backend.settings.docs import DOC_FILES, stale
from lmcache_backend.settings.sources import configured

TRUE = ["1", "true", "yes", "on", "TRUE", " Yes ", "On", True, 1]
FALSE = ["0", "false", "no", "off", "FALSE", " No ", "Off", False, 0]
BOOLEAN = p.boolean().accepts
BOOLEAN_SETTINGS = [s for s in REGISTRY if s.parse.accepts == BOOLEAN]


def test_the_docs_tables_are_the_registrys() -> None:
    """``lmcache-backend config --docs`` regenerates them; run it after changing a key."""
    drift = stale(REPO_ROOT)
    assert not drift, f"run `lmcache-backend config --docs`: {sorted(drift)} differ"


def test_every_doc_file_holds_tables() -> None:
    for doc in DOC_FILES:
        text = (REPO_ROOT / doc).read_text(encoding="utf-8")
        assert "<!-- settings-table:" in text, doc


def test_every_variable_the_docs_name_is_declared() -> None:
    """An ``LMCACHE_*`` variable in the README or the docs is an engine key's variable or a
    declared environment variable: none of them draws an "unknown key" warning."""
    declared = {s.env for s in ENGINE.values()} | set(ENVIRONMENT)
    named = set()
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]:
        named |= set(re.findall(r"\bLMCACHE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text("utf-8")))
    assert named - declared == set()


@pytest.mark.parametrize("setting", BOOLEAN_SETTINGS, ids=lambda s: f"{s.scope.value}:{s.name}")
def test_every_boolean_reads_the_same_words(setting) -> None:
    for word in TRUE:
        assert setting.value(word, "test") is True, word
    for word in FALSE:
        assert setting.value(word, "test") is False, word
    with pytest.raises(ConfigError) as err:
        setting.value("maybe", "test")
    line = str(err.value)
    assert setting.name in line and "'maybe'" in line and "true or false" in line
    assert "\n" not in line


def test_booleans_through_every_reader(monkeypatch) -> None:
    """The same words reach the same value through each scope's reader."""
    from lmcache_backend.integration.vllm.settings import request_config
    from lmcache_backend.storage.settings import store_settings

    for word, value in [("yes", True), ("off", False), ("1", True), ("No", False)]:
        assert load_config(env={"LMCACHE_LOCAL_CPU": word}).local_cpu is value
        config = load_config(env={}, extra_config={"copy_on_get": word})
        assert store_settings(config).copy_on_get is value
        assert read_variable("LMCACHE_BACKEND_FORCE_LMCACHE", {ENVIRONMENT_FORCE: word}) is value
        blending = load_config(env={}, enable_blending=True)
        assert (request_config(blending, {"blend": word}) is None) is (not value)


ENVIRONMENT_FORCE = "LMCACHE_BACKEND_FORCE_LMCACHE"


def test_declared_variables_never_warn(caplog) -> None:
    """Every declared ``LMCACHE_*`` variable, set, and every engine key's variable at its
    default: the loader warns about none of them."""
    env = {name: "1" for name in ENVIRONMENT if name.startswith("LMCACHE_")}
    env["LMCACHE_CONFIG_FILE"] = ""
    for setting in ENGINE.values():
        default = setting.default
        env[setting.env] = (
            ",".join(map(str, default))
            if isinstance(default, list)
            else ("" if default is None else str(default))
        )
    env["LMCACHE_EXTRA_CONFIG"] = "{}"
    with caplog.at_level(logging.WARNING, logger="lmcache_backend"):
        config = load_config(env=env)
    assert caplog.text == ""
    assert config == BlendConfig()


def test_an_undeclared_variable_warns_with_the_closest_declared_one(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_backend"):
        load_config(env={"LMCACHE_KERNEL_CACHES": "/tmp/k", "LMCACHE_BLEND_MIN_TOKEN": "1"})
    assert "did you mean LMCACHE_KERNEL_CACHE?" in caplog.text
    assert "did you mean 'blend_min_tokens' (LMCACHE_BLEND_MIN_TOKENS)?" in caplog.text


def test_a_connector_key_outside_kv_connector_extra_config_says_where_it_belongs(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_backend"):
        load_config(env={"LMCACHE_STATS_FILE": "/tmp/s.jsonl"})
    assert "kv_connector_extra_config only" in caplog.text


def test_a_misspelt_store_key_is_named_and_lmcaches_own_pass(caplog) -> None:
    from lmcache_backend.storage.settings import store_settings

    extra = {"remote_timout": 3, "some_lmcache_key": 1, "lmcache_backend.force_lmcache": False}
    with caplog.at_level(logging.WARNING, logger="lmcache_backend"):
        store_settings(load_config(env={}, extra_config=extra))
    assert "did you mean 'remote_timeout'?" in caplog.text
    assert "some_lmcache_key" not in caplog.text and "force_lmcache" not in caplog.text


def test_defaults_are_the_registrys() -> None:
    """Each object holding values is built from its scope: one field per key, defaulting to the
    key's declared default, and every default passes its own parser."""
    from lmcache_backend.integration.vllm.settings import ConnectorSettings
    from lmcache_backend.storage.settings import EXTRA_DEFAULTS, StoreSettings

    config = BlendConfig()
    assert [f.name for f in fields(config) if f.name != "sources"] == list(ENGINE)
    assert {name: getattr(config, name) for name in ENGINE} == {
        name: s.default for name, s in ENGINE.items()
    }
    store = StoreSettings()
    for name, setting in STORE.items():
        if not setting.name.startswith("shared_secret"):
            assert getattr(store, name) == setting.default
    assert EXTRA_DEFAULTS == {name: s.default for name, s in STORE.items()}
    connector = {f.name for f in fields(ConnectorSettings)}
    assert set(CONNECTOR) <= connector
    for setting in REGISTRY:
        assert setting.value(setting.default_value(), "test") == setting.default, setting.name
        assert setting.description and "\n" not in setting.description


def test_request_keys_are_blend_and_the_per_request_engine_keys() -> None:
    assert list(REQUEST) == [
        "blend",
        "lmcache.skip_save",
        "lmcache.staleness_probes",
        "blend_recompute_ratios",
        "blend_check_layers",
        "blend_selection",
        "blend_min_read_share",
        "blend_max_recompute_ratio",
        "blend_max_divergence",
    ]


def test_a_former_name_still_works_and_says_the_new_one(caplog) -> None:
    from lmcache_backend.settings import parse_given

    with caplog.at_level(logging.WARNING, logger="lmcache_backend"):
        values = parse_given(CONNECTOR, {"profile": "yes"}, "kv_connector_extra_config")
    assert values == {"time_phases": True}
    assert "profile (from kv_connector_extra_config) is now called time_phases" in caplog.text


def test_the_yaml_backend_reaches_code_handed_no_configuration(tmp_path) -> None:
    """``get_ops()`` with no name (LMCache's legacy executor) reads ``backend`` from the YAML
    file too, not only from ``LMCACHE_BACKEND``."""
    path = tmp_path / "lmcache.yaml"
    path.write_text("backend: torch\n")
    assert configured("backend", {"LMCACHE_CONFIG_FILE": str(path)}) == "torch"
    env = {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_BACKEND": "cpu"}
    assert configured("backend", env) == "cpu"  # the variable wins, as in load_config
    assert configured("backend", {}) == "auto"
    with pytest.raises(ConfigError, match=r"backend \(from LMCACHE_BACKEND\) = 'tpu'"):
        configured("backend", {"LMCACHE_BACKEND": "tpu"})


def test_get_ops_follows_the_yaml_file(tmp_path, monkeypatch) -> None:
    from lmcache_backend.ops import get_ops

    path = tmp_path / "lmcache.yaml"
    path.write_text("backend: torch\n")
    monkeypatch.delenv("LMCACHE_BACKEND", raising=False)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    assert get_ops().name == "torch"


# -- nothing reads a setting from the environment outside the registry -----------------------

#: reads of ``os.environ`` that are not settings, each with its reason
NOT_SETTINGS = {
    # adds the interpreter's scripts folder to PATH so that torch finds the `ninja` it runs
    ("backends/cpu/tiled_attention.py", "PATH"),
}
#: the registry's reader of variables, and its writer (which hands the environment on whole)
REGISTRY_MODULES = ("lmcache_backend/settings/environment.py", "lmcache_backend/settings/writer.py")


def _environ_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, variable)`` of every read of one variable: ``os.environ.get(X)``,
    ``os.environ[X]`` (loaded), ``os.getenv(X)``, ``X in os.environ``; and ``(line, "*")``
    where ``os.environ`` itself is handed on (``env = os.environ``), to be read elsewhere.
    Writes (``os.environ[X] = ...``, ``setdefault``, ``update``, ``pop``) and copies for a child
    process (``dict(os.environ)``, ``{**os.environ}``) are no reads of a setting."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    def name(node: ast.AST) -> str:
        return node.value if isinstance(node, ast.Constant) else ast.unparse(node)

    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "getenv":
                out.append((node.lineno, name(node.args[0]) if node.args else "?"))
        if not is_environ(node):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute):  # a method: get reads, the others write
            if parent.attr == "get":
                call = parents.get(parent)
                out.append((node.lineno, name(call.args[0]) if call.args else "?"))
            elif parent.attr not in ("setdefault", "update", "pop"):
                out.append((node.lineno, f"os.environ.{parent.attr}"))
        elif isinstance(parent, ast.Subscript):
            if isinstance(parent.ctx, ast.Load):
                out.append((node.lineno, name(parent.slice)))
        elif isinstance(parent, ast.Compare):
            out.append((node.lineno, name(parent.left)))
        elif isinstance(parent, ast.Call) and ast.unparse(parent.func) == "dict":
            continue  # a copy, handed to a child process
        elif isinstance(parent, ast.Dict) and None in parent.keys:
            continue  # {**os.environ, ...}: a copy, handed to a child process
        else:
            out.append((node.lineno, "*"))
    return out


def test_no_setting_is_read_from_the_environment_outside_the_registry() -> None:
    found = []
    for folder in ("lmcache_backend", "backends", "patches"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel in REGISTRY_MODULES:
                continue
            for line, variable in _environ_reads(ast.parse(path.read_text("utf-8"))):
                if (rel, variable) not in NOT_SETTINGS:
                    found.append(f"{rel}:{line} reads {variable}")
    assert found == [], "read it through lmcache_backend.settings.read_variable: " + str(found)


def test_the_scan_sees_every_form_of_read() -> None:
    """The scan above fails on each way of reading a variable (else it could pass blind)."""
    source = (
        "import os\n"
        "a = os.environ.get('A')\n"
        "b = os.environ['B']\n"
        "c = os.getenv('C')\n"
        "d = 'D' in os.environ\n"
        "env = os.environ if x is None else x\n"
        "e = os.environ.items()\n"
        "os.environ['W'] = '1'\n"
        "os.environ.setdefault('S', '1')\n"
        "child = dict(os.environ)\n"
        "other = {**os.environ, 'X': '1'}\n"
    )
    found = [v for _, v in sorted(_environ_reads(ast.parse(source)))]
    assert found == ["A", "B", "C", "D", "*", "os.environ.items"]
