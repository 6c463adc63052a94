"""A user's mistake at any command is one line on stderr naming what is wrong and what is
accepted, with a non-zero exit status and no traceback (``-v`` adds the traceback); ``--version``,
and help text for every option.

Every case stops before an engine starts: ``serve`` checks its configuration, model and memory
first (:mod:`lmcache_backend.integration.vllm.serving.checks`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_backend.cli import build_parser, main
from lmcache_backend.errors import MAX_LINE, missing_module_hint, one_line
from lmcache_backend.version import __version__

#: (argv, environment, what the line names)
MISTAKES = [
    (["serve", "--enforce-eager"], {"LMCACHE_BLEND_RECOMPUTE_RATIOS": "1.5"}, "1.5"),
    (["config"], {"LMCACHE_BLEND_RECOMPUTE_RATIOS": "1.5"}, "LMCACHE_BLEND_RECOMPUTE_RATIOS"),
    (["serve", "/no/such/model"], {}, "/no/such/model"),
    (["verify", "/no/such/model"], {}, "/no/such/model"),
    (["doctor", "--vllm", "banana"], {}, "banana"),
    (["doctor", "--vllm", "0.33.0", "--vllm-ascend", "x.y"], {}, "x.y"),
    (["serve"], {"VLLM_CPU_KVCACHE_SPACE": "abc"}, "VLLM_CPU_KVCACHE_SPACE"),
    (["serve"], {"VLLM_CPU_KVCACHE_SPACE": "100000"}, "VLLM_CPU_KVCACHE_SPACE=100000"),
    (["serve", "--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization"),
    (["serve", "--kv-transfer-config", "{bad"], {}, "--kv-transfer-config"),
    (["serve"], {"LMCACHE_BLEND_CHECK_LAYERS": "99"}, "the model has 30 layers"),
    (["serve"], {"LMCACHE_CONFIG_FILE": "/no/such.yaml"}, "LMCACHE_CONFIG_FILE"),
    (["demo"], {"LMCACHE_BLEND_SELECTION": "best"}, "blend_selection"),
    (["demo", "--ratio", "1.5"], {}, "--ratio"),
]


def _clean_env(monkeypatch, env: dict[str, str]) -> None:
    for key in ("VLLM_CPU_KVCACHE_SPACE", "LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("argv, env, named", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(monkeypatch, capsys, argv, env, named) -> None:
    _clean_env(monkeypatch, env)
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("lmcache-backend "), err
    assert named in err and "Traceback" not in err, err


def test_verbose_adds_the_traceback(monkeypatch, capsys) -> None:
    _clean_env(monkeypatch, {"LMCACHE_BLEND_RECOMPUTE_RATIOS": "1.5"})
    assert main(["-v", "config"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("lmcache-backend config: ")
    assert main(["-v", "serve", "/no/such/model"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_missing_optional_package_names_its_extra(monkeypatch, capsys) -> None:
    # transformers as if not installed: `demo --engine hf` needs it (the [hf] extra)
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["demo", "--engine", "hf", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "transformers" in err and "[hf]" in err, err
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert "[cuda], [cpu] or [ascend]" in missing_module_hint("vllm.entrypoints")
    monkeypatch.setitem(sys.modules, "llama_index", None)
    assert missing_module_hint("llama_index.core").endswith("pip install -e '.[clients]')")
    # a defect keeps its traceback: a module of this package, a submodule an installed package
    # lacks (a version mismatch, not a missing install)
    assert missing_module_hint("lmcache_backend.nothing") is None
    assert missing_module_hint("triton.no_such_module") is None


def test_a_long_message_is_cut_to_one_bounded_line() -> None:
    line = one_line("x" * 5000 + "\nsecond line")
    assert len(line) == MAX_LINE and line.endswith("...") and "second" not in line


def test_an_unexpected_error_keeps_its_traceback(monkeypatch) -> None:
    from lmcache_backend.commands import doctor

    def broken(args):
        raise KeyError("a defect")

    monkeypatch.setattr(doctor, "main", broken)
    with pytest.raises(KeyError):
        main(["doctor"])


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"lmcache-backend {__version__}\n"


def _actions(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _actions(sub, sub_name)
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield name, action


def test_every_option_has_help_text() -> None:
    from lmcache_backend.integration.vllm.serving.serve import help_parser

    actions = [*_actions(build_parser(), "lmcache-backend"), *_actions(help_parser(), "serve")]
    assert len(actions) > 50
    missing = [(name, a.option_strings or a.dest) for name, a in actions if not a.help]
    assert not missing, missing


@pytest.mark.slow
def test_serve_help_lists_its_own_options_then_vllms() -> None:
    pytest.importorskip("vllm")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_backend", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    ours, theirs = out.find("--stats-file PATH"), out.find("usage: vllm serve")
    assert 0 <= ours < theirs, out[:3000]
    assert "smollm2 (the default" in out and "VLLM_CPU_KVCACHE_SPACE" in out[:theirs]
    assert "--max-model-len" in out[theirs:] or "ModelConfig" in out[theirs:]
