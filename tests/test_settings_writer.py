"""The one writer of variables (lmcache_backend.settings.writer) and the command-line flags parsed
by the registry's parsers (lmcache_backend.settings.arguments): values written as their parsers
read them back, bad ones refused with the setting's error; and scans that find no variable
written by name, no write to the process environment and no setting's range checked again
anywhere else."""

from __future__ import annotations

import argparse
import ast
import os

import pytest
from repo_paths import REPO_ROOT

from lmcache_backend.config import ConfigError, load_config
from lmcache_backend.settings import ENGINE, ENVIRONMENT, read_variable
from lmcache_backend.settings.arguments import parse_option, setting_type
from lmcache_backend.settings.codegen import key_of
from lmcache_backend.settings.writer import (
    STARTED_ENGINE,
    STARTED_KV_CACHE_GIB,
    Variables,
    child_env,
    export,
    variable,
    variables,
)

# -- the writer ---------------------------------------------------------------------------------


def test_every_engine_key_and_variable_has_a_typed_name() -> None:
    declared = set(Variables.__annotations__)
    assert declared == {key_of(s) for s in (*ENGINE.values(), *ENVIRONMENT.values())}
    assert variable("blend_recompute_ratios") == "LMCACHE_BLEND_RECOMPUTE_RATIOS"
    assert variable("vllm_cpu_kvcache_space") == "VLLM_CPU_KVCACHE_SPACE"
    with pytest.raises(KeyError):
        variable("blend_recompute_ratio")


def test_written_values_load_back_as_given() -> None:
    """What the writer writes, the loader reads back to the same values."""
    given: Variables = {
        "enable_blending": True,
        "blend_recompute_ratios": [0.3, 0.15],
        "blend_check_layers": [1, 2],
        "blend_selection": "kv_deviation",
        "blend_special_str": " # # ",
        "max_local_cpu_size": 0.25,
        "local_disk": None,
        "extra_config": {"remote_timeout": 2.0, "cache_policy": "lru"},
    }
    env = child_env({}, **given)
    assert "LMCACHE_LOCAL_DISK" not in env
    config = load_config(env=env)
    for key, value in given.items():
        assert getattr(config, key) == value, key
    assert config.sources["blend_recompute_ratios"] == "LMCACHE_BLEND_RECOMPUTE_RATIOS"
    assert read_variable("VLLM_CPU_KVCACHE_SPACE", child_env({}, vllm_cpu_kvcache_space=3)) == 3


def test_defaults_keep_what_the_environment_says_and_values_override_it() -> None:
    base = {"VLLM_CPU_KVCACHE_SPACE": "7", "LMCACHE_ENABLE_BLENDING": "false", "PATH": "/bin"}
    env = child_env(base, defaults=STARTED_ENGINE)
    assert env == {**base}  # both already set: the user's values stay
    env = child_env({"PATH": "/bin"}, defaults=STARTED_ENGINE)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(STARTED_KV_CACHE_GIB)
    assert load_config(env=env).enable_blending is True
    env = child_env(base, defaults=STARTED_ENGINE, enable_blending=True, triton_interpret=None)
    assert env["LMCACHE_ENABLE_BLENDING"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "7"
    assert base["LMCACHE_ENABLE_BLENDING"] == "false"  # the base is copied, never changed
    assert "TRITON_INTERPRET" not in child_env({"TRITON_INTERPRET": "1"}, triton_interpret=None)


def test_booleans_are_written_as_vllm_reads_its_own() -> None:
    """vLLM reads some of its boolean variables with ``bool(int(...))``: 1 or 0."""
    written = variables({"vllm_allow_insecure_serialization": True, "enable_blending": False})
    assert written == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "LMCACHE_ENABLE_BLENDING": "0"}
    assert bool(int(written["VLLM_ALLOW_INSECURE_SERIALIZATION"]))


def test_a_bad_value_is_refused_with_the_settings_error() -> None:
    with pytest.raises(
        ConfigError, match=r"blend_recompute_ratios .* expected a number in \[0, 1\]"
    ):
        child_env({}, blend_recompute_ratios=[1.5])
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE"):
        variables({"vllm_cpu_kvcache_space": 0})
    with pytest.raises(KeyError):
        child_env({}, **{"blend_recompute_ratio": [0.2]})  # type: ignore[typeddict-unknown-key]


def test_export_writes_this_processs_environment(monkeypatch) -> None:
    monkeypatch.delenv("LMCACHE_BLEND_MIN_TOKENS", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    export(defaults={"vllm_cpu_kvcache_space": 2, "blend_min_tokens": 64})
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "5"
    assert load_config().blend_min_tokens == 64


# -- command-line flags -------------------------------------------------------------------------


def test_flags_parse_with_the_registrys_parsers() -> None:
    assert parse_option("blend_recompute_ratios", "0.05,0.15") == [0.05, 0.15]
    assert parse_option("blend_recompute_ratios", "0.3", "item") == 0.3
    assert parse_option("blend_min_read_share", "0.5,0.8", "list") == [0.5, 0.8]
    parser = argparse.ArgumentParser(prog="x", exit_on_error=False)
    parser.add_argument("--ratio", type=setting_type("blend_recompute_ratios", "item"))
    assert parser.parse_args(["--ratio", "1"]).ratio == 1.0
    for bad in ("1.5", "-0.1", "nan", "x"):
        with pytest.raises(argparse.ArgumentError, match="blend_recompute_ratios"):
            parser.parse_args(["--ratio", bad])


def test_the_demo_and_the_bench_refuse_what_the_configuration_refuses(capsys) -> None:
    from lmcache_backend.bench.arguments import add_arguments as bench_arguments
    from lmcache_backend.demos import add_arguments as demo_arguments

    for add, argv in [
        (demo_arguments, ["--ratio", "1.5"]),
        (bench_arguments, ["--ratios", "0.1,1.5"]),
        (bench_arguments, ["--oracle-ratios", "2"]),
        (bench_arguments, ["--read-shares", "1.0"]),
        (bench_arguments, ["--check-layers", "2,1"]),
        (bench_arguments, ["--selections", "kv_deviation,nope"]),
        (bench_arguments, ["--gradual", "1,2:0.3,0.2,0.1"]),
        (bench_arguments, ["--gradual", "1,2:0.3,1.2"]),
    ]:
        parser = argparse.ArgumentParser()
        add(parser)
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert "(from " in err and argv[1].split(",")[-1].split(":")[-1] in err, err


# -- nothing writes a variable, or checks a setting's range, anywhere else ----------------------

SCANNED = ("lmcache_backend", "backends", "patches", "benchmarks", "tools")
#: the writer itself, and the registry's modules that declare the variables
REGISTRY = "lmcache_backend/settings/"
#: writes of the process environment that are not settings, each with its reason
NOT_SETTINGS = {
    # adds the interpreter's scripts folder to PATH so that torch finds the `ninja` it runs
    ("backends/cpu/tiled_attention.py", "PATH"),
    # Triton's own switch to its interpreter, for the CPU rehearsal of the GPU machine's vLLM
    ("tools/vllm_bundle/cuda_on_cpu.py", "TRITON_INTERPRET"),
    # huggingface_hub's switch off the network, for the GPU machine, which has none
    ("lmcache_backend/hardware/vllm_engine.py", "HF_HUB_OFFLINE"),
}
#: ranges checked outside the registry that are no setting's, each with its reason
OWN_RANGES = {
    # the MuSiQue data set's passage counts (2..10 per example), not a setting
    ("lmcache_backend/bench/datasets/musique.py", "2 <= int(count) <= 10"),
    # vLLM's own option --gpu-memory-utilization, checked before vLLM starts
    ("lmcache_backend/integration/vllm/serving/checks.py", "0 < share <= 1"),
    # a TCP port in a Redis URL
    ("lmcache_backend/storage/remote/url.py", "0 < number < 65536"),
    # the tensor ranks an Ascend kernel takes; the head sizes the CUDA kernels compile for
    ("backends/ascend/rows.py", "1 <= dst.dim() <= 8"),
    ("backends/cuda/attention.py", "16 <= d <= 256"),
}


def _declared_names() -> set[str]:
    return {s.env for s in (*ENGINE.values(), *ENVIRONMENT.values()) if s.env}


def _is_variable(node: ast.AST | None, declared: set[str]) -> bool:
    """A literal variable name: a declared one, or any ``LMCACHE_*`` / ``VLLM_*``."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    name = node.value
    return name in declared or (
        name.startswith(("LMCACHE_", "VLLM_")) and name.replace("_", "").isalnum()
    )


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def variable_writes(tree: ast.AST, declared: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` of every write of a variable by its literal name (``env["X"] = ...``,
    ``{"X": ...}``, ``f(X=...)``, ``env.setdefault("X", ...)``, ``env.pop("X")``,
    ``os.putenv("X", ...)``) and of every write of the process environment itself
    (``os.environ[...] = ...``, ``os.environ.update/setdefault/pop/clear(...)``)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript):
                if _is_variable(target.slice, declared):
                    out.append((node.lineno, target.slice.value))  # type: ignore[attr-defined]
                elif _is_environ(target.value):
                    out.append((node.lineno, f"os.environ[{ast.unparse(target.slice)}]"))
        if isinstance(node, ast.Dict):
            out += [(node.lineno, k.value) for k in node.keys if _is_variable(k, declared)]  # type: ignore[union-attr]
        if isinstance(node, ast.Call):
            out += [
                (node.lineno, kw.arg)
                for kw in node.keywords
                if kw.arg and _is_variable(ast.Constant(kw.arg), declared)
            ]
            func = node.func
            if isinstance(func, ast.Attribute):
                first = node.args[0] if node.args else None
                if func.attr in ("setdefault", "pop", "putenv", "unsetenv") and _is_variable(
                    first, declared
                ):
                    out.append((node.lineno, first.value))  # type: ignore[union-attr]
                elif _is_environ(func.value) and func.attr in (
                    "setdefault",
                    "update",
                    "pop",
                    "popitem",
                    "clear",
                ):
                    shown = ast.unparse(first) if first is not None else ""
                    out.append((node.lineno, f"os.environ.{func.attr}({shown})"))
                elif func.attr in ("putenv", "unsetenv"):
                    out.append((node.lineno, f"os.{func.attr}"))
    return out


def range_checks(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, source)`` of every comparison of a value between two literal bounds
    (``0.0 <= x <= 1.0``): the way a setting's range gets checked a second time."""

    def literal(node: ast.AST) -> bool:
        if isinstance(node, ast.UnaryOp):
            node = node.operand
        return isinstance(node, ast.Constant) and isinstance(node.value, (int, float))

    return [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and len(node.comparators) == 2
        and literal(node.left)
        and literal(node.comparators[1])
    ]


def _sources():
    for folder in SCANNED:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if not rel.startswith(REGISTRY):
                yield rel, ast.parse(path.read_text("utf-8"))


def test_no_variable_is_written_outside_the_writer() -> None:
    declared = _declared_names()
    found = [
        f"{rel}:{line} writes {what}"
        for rel, tree in _sources()
        for line, what in variable_writes(tree, declared)
        if (rel, what.removeprefix("os.environ[").strip("']\"")) not in NOT_SETTINGS
    ]
    assert found == [], "write it with lmcache_backend.settings.writer: " + str(found)


def test_no_setting_range_is_checked_outside_the_registry() -> None:
    found = [
        f"{rel}:{line}: {source}"
        for rel, tree in _sources()
        for line, source in range_checks(tree)
        if (rel, source) not in OWN_RANGES
    ]
    assert found == [], (
        "parse the value with the setting's parser (lmcache_backend.settings.arguments."
        "setting_type, Setting.value): " + str(found)
    )


def test_the_scans_see_every_form() -> None:
    """Each scan fails on each form it looks for (else it could pass blind)."""
    declared = {"OMP_NUM_THREADS"}
    source = (
        "import os\n"
        "env['LMCACHE_ENABLE_BLENDING'] = 'true'\n"
        "env = {'VLLM_CPU_KVCACHE_SPACE': '1', **os.environ}\n"
        "env.setdefault('OMP_NUM_THREADS', '2')\n"
        "env.pop('VLLM_X', None)\n"
        "start(LMCACHE_LOCAL_CPU='false')\n"
        "os.environ['PATH'] = '/bin'\n"
        "os.environ.update(more)\n"
        "os.putenv('A', '1')\n"
        "read = os.environ.get('LMCACHE_REMOTE_URL')\n"
        "name = variable('remote_url')\n"
        "ok = 0.0 <= ratio <= 1.0\n"
        "fine = low <= ratio <= high\n"
    )
    tree = ast.parse(source)
    assert [what for _, what in sorted(variable_writes(tree, declared))] == [
        "LMCACHE_ENABLE_BLENDING",
        "VLLM_CPU_KVCACHE_SPACE",
        "OMP_NUM_THREADS",
        "VLLM_X",
        "LMCACHE_LOCAL_CPU",
        "os.environ['PATH']",
        "os.environ.update(more)",
        "os.putenv",
    ]
    assert range_checks(tree) == [(12, "0.0 <= ratio <= 1.0")]
