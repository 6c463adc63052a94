"""The vllm-ascend worker patcher, against the worker files of the released vllm-ascend wheels.

Each release is downloaded once (``pip download --no-deps``) into ``<repo>/.cache/vllm-ascend/``
and reused; tests of a release that cannot be downloaded are skipped with pip's message.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from lmcache_backend.model_tracker import ENGINE_NAME, ModelTracker
from lmcache_backend.patches import apply_patch, vllm_ascend_worker

REPO = REPO_ROOT
CACHE = REPO / ".cache" / "vllm-ascend"
SCRIPT = REPO / "patches" / "apply_patch.py"

# release -> (V1 worker inside the wheel, where KV transfer starts once patched)
RELEASES = {
    "0.9.1": ("vllm_ascend/worker/worker_v1.py", "load_model"),
    "0.11.0": ("vllm_ascend/worker/worker_v1.py", "load_model"),
    "0.13.0": ("vllm_ascend/worker/worker.py", "load_model"),
    "0.18.0": ("vllm_ascend/worker/worker.py", "initialize_from_config"),
    "0.23.0": ("vllm_ascend/worker/worker.py", "initialize_from_config"),
}
V0_WORKER = ("0.9.1", "vllm_ascend/worker/worker.py")
DIST = "_init_worker_distributed_environment"
# The wheels are platform-specific, but only their Python files are read: ask for the x86_64
# CPython 3.11 wheels whatever machine runs the tests.
PIP_PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--platform=manylinux_2_34_x86_64",
    "--platform=manylinux_2_24_x86_64",
    "--platform=manylinux2014_x86_64",
    "--python-version=3.11",
    "--implementation=cp",
    "--abi=cp311",
]


# --------------------------------------------------------------------------------------------
# Released files


@functools.cache
def _wheel(version: str) -> Path | str:
    """The cached wheel of ``version``, downloading it if needed; a reason string on failure."""
    CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE.glob(f"vllm_ascend-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--timeout=30", "--retries=1"]
    cmd += [*PIP_PLATFORM_ARGS, f"vllm-ascend=={version}", "-d", str(CACHE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"pip download vllm-ascend=={version} failed: {exc}"
    found = sorted(CACHE.glob(f"vllm_ascend-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return f"registry not reachable or no wheel of vllm-ascend=={version}: {tail}"
    return found[0]


@functools.cache
def _released(version: str, member: str) -> bytes | str:
    wheel = _wheel(version)
    if isinstance(wheel, str):
        return wheel
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(member)


def released_bytes(version: str, member: str) -> bytes:
    """Bytes of ``member`` in the wheel of ``version``; skips the test if it cannot be had."""
    data = _released(version, member)
    if isinstance(data, str):
        pytest.skip(data)
    return data


@dataclass
class Worker:
    """A released worker file copied into a temporary folder."""

    version: str
    path: Path
    original: bytes

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


@pytest.fixture(scope="session", autouse=True)
def _download_all() -> None:
    """Fetch every release once, before the first test, so no test pays for it alone."""
    for version, (member, _) in RELEASES.items():
        _released(version, member)


@pytest.fixture(params=sorted(RELEASES, key=apply_patch._version_tuple))
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Worker:
    version = request.param
    member = RELEASES[version][0]
    data = released_bytes(version, member)
    path = tmp_path / Path(member).name
    path.write_bytes(data)
    return Worker(version, path, data)


def run_main(*args: str | Path) -> int:
    return apply_patch.main([str(a) for a in args])


# --------------------------------------------------------------------------------------------
# Reading a worker file by its structure


def _worker_methods(text: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(text)
    classes = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef)
        and any(isinstance(m, ast.FunctionDef) and m.name == "load_model" for m in n.body)
    ]
    assert len(classes) == 1
    return {m.name: m for m in classes[0].body if isinstance(m, ast.FunctionDef)}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _calls(func: ast.AST, name: str) -> list[ast.Call]:
    """Calls in ``func`` of ``name`` (a dotted name, or the last part of one)."""
    return [
        n
        for n in ast.walk(func)
        if isinstance(n, ast.Call)
        and (_dotted(n.func) == name or _dotted(n.func).endswith("." + name))
    ]


def _kv_calls(text: str) -> list[tuple[str, str]]:
    """``(method, call source)`` of every KV-transfer initialisation in the worker class."""
    found = []
    for name, func in _worker_methods(text).items():
        for call in _calls(func, "ensure_kv_transfer_initialized"):
            found.append((name, ast.get_source_segment(text, call)))
    return found


def _import_alias(func: ast.FunctionDef, module: str, name: str) -> str:
    """The local name ``func`` binds with ``from module import name [as alias]``."""
    for node in ast.walk(func):
        if isinstance(node, ast.ImportFrom) and node.module == module:
            for alias in node.names:
                if alias.name == name:
                    return alias.asname or alias.name
    raise AssertionError(f"load_model does not import {name} from {module}")


def _registrations(load: ast.FunctionDef) -> tuple[ast.Call, ast.Call, ast.Try]:
    """This package's and LMCache's ``register_model`` calls in ``load_model``, and the try."""
    ours = _import_alias(load, "lmcache_backend.model_tracker", "ModelTracker")
    ours_engine = _import_alias(load, "lmcache_backend.model_tracker", "ENGINE_NAME")
    theirs = _import_alias(load, "lmcache.v1.compute.models.utils", "VLLMModelTracker")
    theirs_engine = _import_alias(load, "lmcache.integration.vllm.utils", "ENGINE_NAME")
    own_calls = _calls(load, f"{ours}.register_model")
    lmc_calls = _calls(load, f"{theirs}.register_model")
    assert len(own_calls) == 1 and len(lmc_calls) == 1
    assert _dotted(own_calls[0].args[0]) == ours_engine
    assert _dotted(lmc_calls[0].args[0]) == theirs_engine
    guards = [
        n
        for n in ast.walk(load)
        if isinstance(n, ast.Try)
        and any(h.type is not None and _dotted(h.type) == "ImportError" for h in n.handlers)
        and any(isinstance(s, ast.ImportFrom) and s.module.startswith("lmcache.") for s in n.body)
    ]
    assert len(guards) == 1, "LMCache's import is not guarded by try/except ImportError"
    assert lmc_calls[0] in [n for s in guards[0].orelse for n in ast.walk(s)]
    return own_calls[0], lmc_calls[0], guards[0]


# --------------------------------------------------------------------------------------------
# Applying to each release


def test_apply_registers_after_load_and_starts_kv_once_after_registration(worker: Worker) -> None:
    before = _kv_calls(worker.original.decode())
    assert run_main("--path", worker.path) == 0
    text = worker.text()
    compile(text, str(worker.path), "exec")
    methods = _worker_methods(text)
    load = methods["load_model"]
    own, lmc, _ = _registrations(load)
    model_load_line = max(c.lineno for c in _calls(load, "self.model_runner.load_model"))
    assert model_load_line < own.lineno < lmc.lineno

    kv = _kv_calls(text)
    expected_method = RELEASES[worker.version][1]
    assert [m for m, _ in kv] == [expected_method], kv
    # The same call expression as the release had: no argument dropped or added.
    assert [src for _, src in kv] == [src for _, src in before]
    assert not _calls(methods[DIST], "ensure_kv_transfer_initialized")
    if expected_method == "load_model":
        kv_line = _calls(load, "ensure_kv_transfer_initialized")[0].lineno
        assert kv_line > lmc.lineno, "KV transfer starts before the model is registered"


def test_release_classification(worker: Worker) -> None:
    """Per release: where KV transfer starts before patching, and what the patch does."""
    before = _kv_calls(worker.original.decode())
    moved = RELEASES[worker.version][1] == "load_model"
    assert [m for m, _ in before] == [DIST if moved else "initialize_from_config"]
    if moved:
        assert before[0][1] == "ensure_kv_transfer_initialized(self.vllm_config)"
    else:
        assert before[0][1] == "ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)"
    _, plan = vllm_ascend_worker.status(worker.original.decode())
    assert plan.mode == ("move" if moved else "keep")


def test_dry_run_prints_diff_and_changes_nothing(
    worker: Worker, capsys: pytest.CaptureFixture[str]
) -> None:
    stamp = worker.path.stat().st_mtime_ns
    assert run_main("--path", worker.path, "--dry-run") == 0
    out = capsys.readouterr().out
    assert out.startswith("--- ") and "\n+++ " in out
    assert "+        _LmcbModelTracker.register_model(" in out
    assert worker.path.read_bytes() == worker.original
    assert worker.path.stat().st_mtime_ns == stamp


def test_second_apply_is_byte_identical(worker: Worker, capsys: pytest.CaptureFixture) -> None:
    assert run_main("--path", worker.path) == 0
    once = worker.path.read_bytes()
    assert once != worker.original
    assert run_main("--path", worker.path) == 0
    assert worker.path.read_bytes() == once
    assert "already patched" in capsys.readouterr().out


def test_revert_restores_original_bytes_and_mode(worker: Worker) -> None:
    worker.path.chmod(0o640)
    assert run_main("--path", worker.path) == 0
    assert worker.path.stat().st_mode & 0o777 == 0o640
    assert run_main("--path", worker.path, "--revert") == 0
    assert worker.path.read_bytes() == worker.original
    assert worker.path.stat().st_mode & 0o777 == 0o640
    # Reverting an unpatched file changes nothing.
    assert run_main("--path", worker.path, "--revert") == 0
    assert worker.path.read_bytes() == worker.original
    assert not [p.name for p in worker.path.parent.iterdir() if p != worker.path]


def test_check_exit_codes(worker: Worker, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main("--path", worker.path, "--check") == 1
    assert "not patched" in capsys.readouterr().out
    assert worker.path.read_bytes() == worker.original
    assert run_main("--path", worker.path) == 0
    capsys.readouterr()
    assert run_main("--path", worker.path, "--check") == 0
    assert capsys.readouterr().out.startswith("patched")
    assert run_main("--path", worker.path, "--revert") == 0
    assert run_main("--path", worker.path, "--check") == 1


class _FakeRunner:
    """A model runner whose ``model`` is wrapped after loading, as with ACL graphs."""

    def __init__(self) -> None:
        self.raw = types.SimpleNamespace(name="raw model")

    def load_model(self) -> None:
        self.model = types.SimpleNamespace(wrapped=self.raw)

    def get_model(self) -> object:
        return self.raw


def _lmcache_modules(tracker: dict[str, object]) -> dict[str, types.ModuleType]:
    """Just enough of LMCache for the inserted imports, recording registrations in ``tracker``."""
    names = [
        "lmcache",
        "lmcache.integration",
        "lmcache.integration.vllm",
        "lmcache.integration.vllm.utils",
        "lmcache.v1",
        "lmcache.v1.compute",
        "lmcache.v1.compute.models",
        "lmcache.v1.compute.models.utils",
    ]
    mods = {name: types.ModuleType(name) for name in names}
    mods["lmcache.integration.vllm.utils"].ENGINE_NAME = "lmcache-engine"

    class VLLMModelTracker:
        @staticmethod
        def register_model(name: str, model: object) -> None:
            tracker[name] = model

    mods["lmcache.v1.compute.models.utils"].VLLMModelTracker = VLLMModelTracker
    return mods


def _run_patched_load_model(text: str) -> tuple[_FakeRunner, list[bool]]:
    """Run the patched ``load_model`` alone, on stand-ins for the worker and vLLM."""
    load = _worker_methods(text)["load_model"]
    module = ast.Module(body=[load], type_ignores=[])
    kv_started_with_model: list[bool] = []

    def ensure_kv_transfer_initialized(*args: object) -> None:
        kv_started_with_model.append(ModelTracker.has_model(ENGINE_NAME))

    namespace = {
        "ensure_kv_transfer_initialized": ensure_kv_transfer_initialized,
        "set_current_vllm_config": lambda cfg: contextlib.nullcontext(),
    }
    exec(compile(module, "<load_model>", "exec"), namespace)
    runner = _FakeRunner()
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_sleep_mode=False), weight_transfer_config=None
    )
    self = types.SimpleNamespace(vllm_config=config, model_runner=runner)
    namespace["load_model"](self)
    return runner, kv_started_with_model


@pytest.mark.parametrize("with_lmcache", [True, False], ids=["lmcache", "no-lmcache"])
def test_patched_load_model_runs(
    worker: Worker, with_lmcache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inserted code registers the raw model, then starts KV transfer (where moved)."""
    lmcache_registry: dict[str, object] = {}
    if with_lmcache:
        for name, mod in _lmcache_modules(lmcache_registry).items():
            monkeypatch.setitem(sys.modules, name, mod)
    else:
        monkeypatch.setitem(sys.modules, "lmcache", None)  # import lmcache -> ImportError
    ModelTracker.unregister_model(ENGINE_NAME)
    assert run_main("--path", worker.path) == 0
    try:
        runner, kv_started = _run_patched_load_model(worker.text())
        assert ModelTracker.get_model(ENGINE_NAME) is runner.raw
    finally:
        ModelTracker.unregister_model(ENGINE_NAME)
    assert lmcache_registry == ({"lmcache-engine": runner.raw} if with_lmcache else {})
    moved = RELEASES[worker.version][1] == "load_model"
    assert kv_started == ([True] if moved else [])


# --------------------------------------------------------------------------------------------
# Files the tool must refuse


def test_v0_worker_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = released_bytes(*V0_WORKER)
    path = tmp_path / "worker.py"
    path.write_bytes(data)
    for args in (["--check"], [], ["--dry-run"], ["--revert"]):
        assert run_main("--path", path, *args) == 2, args
        assert "V0 worker" in capsys.readouterr().err
    assert path.read_bytes() == data


# A minimal worker this tool understands; each case below breaks one thing about it.
TEMPLATE = """\
class NPUWorker:
    def load_model(self) -> None:
        with context:
            self.model_runner.load_model()

    def _init_worker_distributed_environment(self) -> None:
        init_distributed_environment()
        ensure_kv_transfer_initialized(self.vllm_config)
"""

# The manual change of LMCache-Ascend's instructions: registration and KV start in load_model.
OTHER_PATCHER = """\
class NPUWorker:
    def load_model(self) -> None:
        with context:
            self.model_runner.load_model()
        VLLMModelTracker.register_model(ENGINE_NAME, self.model_runner.model)
        ensure_kv_transfer_initialized(self.vllm_config)

    def _init_worker_distributed_environment(self) -> None:
        init_distributed_environment()
        # ensure_kv_transfer_initialized(self.vllm_config)
"""

BROKEN = {
    "not-python": ("def load_model(:\n", "not valid Python"),
    "no-worker-class": ("x = 1\n", "expected one worker class"),
    "no-model-load": (TEMPLATE.replace("self.model_runner.load_model()", "pass"), "worker class"),
    "no-kv-init": (
        TEMPLATE.replace("ensure_kv_transfer_initialized(self.vllm_config)", "pass"),
        "found it in nowhere",
    ),
    "kv-init-twice": (
        TEMPLATE + "\n    def init_device(self):\n        ensure_kv_transfer_initialized(x)\n",
        "exactly once",
    ),
    "kv-init-in-unknown-method": (
        TEMPLATE.replace("_init_worker_distributed_environment", "init_device"),
        "KV transfer starts in init_device()",
    ),
    "kv-init-conditional": (
        TEMPLATE.replace(
            "        ensure_kv_transfer_initialized(self.vllm_config)",
            "        if has_kv:\n            ensure_kv_transfer_initialized(self.vllm_config)",
        ),
        "not a plain statement",
    ),
    "load-model-returns-early": (
        TEMPLATE.replace(
            "        with context:", "        if x:\n            return\n        with c:"
        ),
        "return early",
    ),
    "changed-by-another-patcher": (OTHER_PATCHER, "another patcher"),
    "partly-patched": (TEMPLATE + f"        {vllm_ascend_worker.END_MARKER}\n", "partly patched"),
}


def test_template_is_understood(tmp_path: Path) -> None:
    """The base of the broken cases patches cleanly, so each case fails for its own reason."""
    path = tmp_path / "worker.py"
    path.write_text(TEMPLATE)
    assert run_main("--path", path, "--check") == 1
    assert run_main("--path", path) == 0
    assert run_main("--path", path, "--check") == 0


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_unknown_structure_exits_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, message = BROKEN[case]
    path = tmp_path / "worker.py"
    path.write_text(source)
    for args in (["--check"], []):
        assert run_main("--path", path, *args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert path.read_text() == source


def test_kv_init_sharing_its_line_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = TEMPLATE.replace(
        "ensure_kv_transfer_initialized(self.vllm_config)",
        "ensure_kv_transfer_initialized(self.vllm_config); other()",
    )
    path = tmp_path / "worker.py"
    path.write_text(source)
    assert run_main("--path", path) == 2
    assert "shares its line" in capsys.readouterr().err
    assert path.read_text() == source


def test_crlf_file_keeps_its_line_endings(tmp_path: Path) -> None:
    original = TEMPLATE.replace("\n", "\r\n").encode()
    path = tmp_path / "worker.py"
    path.write_bytes(original)
    assert run_main("--path", path) == 0
    patched = path.read_bytes()
    assert b"register_model(" in patched
    assert patched.count(b"\n") == patched.count(b"\r\n")
    compile(patched, str(path), "exec")
    assert run_main("--path", path, "--revert") == 0
    assert path.read_bytes() == original


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main("--path", tmp_path / "absent.py", "--check") == 2
    assert "no such file" in capsys.readouterr().err


def test_edited_block_is_brought_up_to_date(tmp_path: Path) -> None:
    """A block written by another version of the tool is replaced; revert stays exact."""
    path = tmp_path / "worker.py"
    path.write_text(TEMPLATE)
    assert run_main("--path", path) == 0
    current = path.read_text()
    older = current.replace("# KV transfer starts after", "# KV transfer now starts after")
    assert older != current
    path.write_text(older)
    assert run_main("--path", path, "--check") == 0
    assert run_main("--path", path) == 0
    assert path.read_text() == current
    assert run_main("--path", path, "--revert") == 0
    assert path.read_text() == TEMPLATE


# --------------------------------------------------------------------------------------------
# Finding the installed vllm-ascend


def _fake_site(tmp_path: Path, version: str) -> Path:
    """A site folder holding vllm-ascend 0.9.1's two workers and a package that must not load."""
    site = tmp_path / "site"
    pkg = site / "vllm_ascend"
    (pkg / "worker").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('vllm_ascend must not be imported')\n")
    (pkg / "worker" / "worker_v1.py").write_bytes(
        released_bytes("0.9.1", "vllm_ascend/worker/worker_v1.py")
    )
    (pkg / "worker" / "worker.py").write_bytes(released_bytes(*V0_WORKER))
    info = site / f"vllm_ascend-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n"
    )
    return site


def test_default_patches_installed_v1_worker_without_importing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site = _fake_site(tmp_path, "0.9.1")
    monkeypatch.syspath_prepend(str(site))
    v1 = site / "vllm_ascend" / "worker" / "worker_v1.py"
    v0 = site / "vllm_ascend" / "worker" / "worker.py"
    v0_before = v0.read_bytes()
    assert run_main("--check") == 1
    assert run_main() == 0
    assert "vllm-ascend 0.9.1" in capsys.readouterr().out
    assert run_main("--check") == 0
    assert v0.read_bytes() == v0_before
    assert _kv_calls(v1.read_text())[0][0] == "load_model"
    assert "vllm_ascend" not in sys.modules


def test_the_releases_patched_here_are_the_ones_the_tool_names() -> None:
    """The tool's checked range comes from the recorded releases (compat/ascend.py); every one of
    them is patched above (``0.23.0.post1`` ships ``0.23.0``'s worker)."""
    from lmcache_backend.compat.ascend import PATCH_CHECKED
    from lmcache_backend.compat.versions import release

    assert {release(v) for v in PATCH_CHECKED} == {release(v) for v in RELEASES}
    assert (apply_patch.OLDEST_CHECKED, apply_patch.NEWEST_CHECKED) == (
        PATCH_CHECKED[0],
        PATCH_CHECKED[-1],
    )


def test_default_refuses_release_before_0_9_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(_fake_site(tmp_path, "0.7.3")))
    assert run_main("--check") == 2
    assert "older than 0.9.1" in capsys.readouterr().err


def test_default_without_vllm_ascend_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(apply_patch, "_vllm_ascend_dirs", lambda: [])
    monkeypatch.setattr(apply_patch, "_dist_dirs", lambda: [])
    monkeypatch.setattr(apply_patch, "installed_version", lambda: None)
    assert run_main() == 2
    assert "vllm-ascend is not installed" in capsys.readouterr().err


def test_check_with_dry_run_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        run_main("--check", "--dry-run")
    assert exc.value.code == 2


# --------------------------------------------------------------------------------------------
# The script entry point


def _script(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
    )


@pytest.mark.parametrize("version", ["0.11.0", "0.18.0"])
def test_script_entry(version: str, tmp_path: Path) -> None:
    member = RELEASES[version][0]
    original = released_bytes(version, member)
    path = tmp_path / Path(member).name
    path.write_bytes(original)
    assert _script("--path", path, "--check", cwd=tmp_path).returncode == 1
    dry = _script("--path", path, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0 and "+++ " in dry.stdout
    assert path.read_bytes() == original
    assert _script("--path", path, cwd=tmp_path).returncode == 0
    patched = path.read_bytes()
    assert b"_LmcbModelTracker.register_model(" in patched
    assert patched == _patched_in_process(original, tmp_path)
    assert _script("--path", path, "--check", cwd=tmp_path).returncode == 0
    assert _script("--path", path, "--revert", cwd=tmp_path).returncode == 0
    assert path.read_bytes() == original


def _patched_in_process(original: bytes, tmp_path: Path) -> bytes:
    other = tmp_path / "in_process.py"
    other.write_bytes(original)
    assert run_main("--path", other) == 0
    return other.read_bytes()


def test_script_entry_refuses_unknown_file(tmp_path: Path) -> None:
    path = tmp_path / "worker.py"
    path.write_text("print('hello')\n")
    proc = _script("--path", path, cwd=tmp_path)
    assert proc.returncode == 2
    assert "not a vllm-ascend worker this tool understands" in proc.stderr
    assert path.read_text() == "print('hello')\n"
