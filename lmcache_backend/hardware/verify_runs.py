"""Step 3: ``verify`` through vLLM on the device, one engine per tiny model, attention backend and
mode (eager, or CUDA/ACL graphs), each in its own child process.

The models are the tests' tiny random-weight Llama-3.1 and Qwen3 folders
(:mod:`lmcache_backend.data.tiny_models`), served in bf16. The backend is selected the way the
installed release takes it (:func:`lmcache_backend.hardware.probe.selection_method`):
``LLM(attention_backend=...)`` where ``EngineArgs`` has the field, else the
``VLLM_ATTENTION_BACKEND`` variable. On an NPU vllm-ascend picks its own backend.

Child: ``python -m lmcache_backend.hardware.verify_runs --model-dir DIR --backend NAME
--selection engine_arg|env|default [--graphs] --json FILE``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lmcache_backend.hardware.children import (
    device_env,
    python_module,
    run_child,
    shell_line,
    tail,
)
from lmcache_backend.hardware.probe import NPU_DEFAULT
from lmcache_backend.hardware.table import DRY, FAIL, PASS, SKIPPED, Row
from lmcache_backend.settings.writer import Variables, child_env, export, variables

STEP = "verify"

#: Llama and Qwen, the families the backends are run for.
DEFAULT_MODELS = ("llama31", "qwen3")

#: The tiny models need little; the rest stays free for the next engine's memory check.
GPU_MEMORY_UTILIZATION = 0.5


@dataclass(frozen=True)
class Case:
    """One engine: a tiny model, an attention backend (its enum member) and the mode."""

    model: str
    backend: str
    member: str | None
    graphs: bool

    @property
    def label(self) -> str:
        mode = "graphs" if self.graphs else "eager"
        return f"{self.model}, {self.backend}, {mode}"

    @property
    def slug(self) -> str:
        """The label as a file name."""
        return re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")


def invocation(
    backend_member: str | None, selection: str | None, graphs: bool
) -> tuple[dict, Variables]:
    """``(llm_kwargs for verify_vllm, environment variables to set)`` for one case; the parent
    prints them in the dry run and the child calls the same function."""
    kwargs: dict = {"enforce_eager": not graphs, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
    env: Variables = {}
    if backend_member is not None:
        if selection == "engine_arg":
            kwargs["attention_backend"] = backend_member
        else:
            env["vllm_attention_backend"] = backend_member
    return kwargs, env


def child_command(case: Case, model_dir: Path, selection: str | None, out: Path) -> list[str]:
    args = ["--model-dir", str(model_dir), "--backend", case.member or NPU_DEFAULT]
    args += ["--selection", selection or "default", "--json", str(out)]
    return python_module(
        "lmcache_backend.hardware.verify_runs", *args, *(["--graphs"] * case.graphs)
    )


#: How a check's value reads in the table, by the start of its name after the label.
_SHORT = (
    ("max first-token", "max logprob diff {}"),
    ("greedy answers", "{} answers equal"),
    ("chunks reused", "{}"),
)


def _short(what: str, value: str) -> str:
    form = next((f for start, f in _SHORT if what.startswith(start)), what + " {}")
    return form.format(value)


def summarize(checks: list[dict]) -> str:
    """The checks in one cell: failures first by name, then every value grouped by label
    (``ratio 1.0``, ``default``)."""
    failed = [
        f"FAILED {c['name']}: {c['value']} (limit {c['limit']})"
        for c in checks
        if c["passed"] is False
    ]
    groups: dict[str, list[str]] = {}
    for c in checks:
        label, _, what = c["name"].partition(": ")
        if what:
            groups.setdefault(label, []).append(_short(what, c["value"]))
        else:
            groups.setdefault("", []).append(f"{label} {c['value']}")
    values = "; ".join(
        f"{label}: {', '.join(v)}" if label else ", ".join(v) for label, v in groups.items()
    )
    return "; ".join([*failed, values])


def tiny_model_dir(name: str, cache: Path) -> Path:
    """The tiny model's folder, written once per transformers version (its config format)."""
    import transformers

    from lmcache_backend.data.tiny_models import build_tiny_model

    return build_tiny_model(name, cache / f"tiny-{name}-tf{transformers.__version__}")


def cases(info: dict, models: list[str]) -> tuple[list[Case], list[Row]]:
    """The cases from the probe's backends, and a row for each backend not offered here."""
    runnable, missing = [], []
    for backend, entry in info.get("backends", {}).items():
        if entry["missing"]:
            missing.append(
                Row(STEP, f"{backend} (every model and mode)", SKIPPED, entry["missing"])
            )
            continue
        for model in models:
            for graphs in (False, True):
                runnable.append(Case(model, backend, entry["name"], graphs))
    if not info.get("backends"):
        why = info.get("vllm_error", "the probe found no attention backend")
        missing.append(Row(STEP, "every backend", FAIL, why))
    return runnable, missing


def run(info: dict, models: list[str], cache: Path, logs: Path, dry_run: bool) -> list[Row]:
    """One row per case (each a child on the device; dry: commands and arguments printed)."""
    todo, rows = cases(info, models)
    selection = info.get("selection")
    dirs = {m: tiny_model_dir(m, cache) for m in models}
    for case in todo:
        out = logs / f"verify-{case.slug}.json"
        cmd = child_command(case, dirs[case.model], selection, out)
        kwargs, env_changes = invocation(case.member, selection, case.graphs)
        if dry_run:
            print(
                f"  would run: {shell_line(cmd, variables(env_changes))}\n"
                f"    verify_vllm llm_kwargs={kwargs}"
            )
            rows.append(Row(STEP, case.label, DRY, DRY))
            continue
        out.unlink(missing_ok=True)
        env = child_env(device_env(False), **env_changes)
        rc = run_child(cmd, logs / f"verify-{case.slug}.log", env=env, timeout=1800)
        try:
            result = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            why = tail(logs / f"verify-{case.slug}.log")
            rows.append(Row(STEP, case.label, FAIL, f"exit status {rc}: {why}"))
            continue
        verdict = PASS if result["passed"] else FAIL
        took = f"; {result['seconds']:.0f} s"
        rows.append(Row(STEP, case.label, verdict, summarize(result["checks"]) + took))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Child: one ``verify_vllm`` run in bf16, its checks written as JSON."""
    parser = argparse.ArgumentParser(description="one verify_vllm run (hardware check)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--backend", required=True, help=f"enum member, or {NPU_DEFAULT!r}")
    parser.add_argument("--selection", choices=("engine_arg", "env", "default"), required=True)
    parser.add_argument("--graphs", action="store_true", help="CUDA/ACL graphs (not eager)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    member = None if args.backend == NPU_DEFAULT else args.backend
    kwargs, env_changes = invocation(member, args.selection, args.graphs)
    export(**env_changes)  # the parent sets them too; here for a hand-run child

    from lmcache_backend.commands.verify import verify_vllm

    start = time.monotonic()
    checks, _ = verify_vllm(args.model_dir, dtype="bfloat16", llm_kwargs=kwargs)
    result = {
        "passed": all(c.passed is not False for c in checks),
        "checks": [asdict(c) for c in checks],
        "seconds": time.monotonic() - start,
    }
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
