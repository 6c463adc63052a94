"""Patch of vllm-ascend's NPU worker: ``vllm_ascend.worker.worker_v1.NPUWorker`` (``worker.py``
from vllm-ascend 0.13.0 on).

Why
    CacheBlend recomputes a few tokens of every reused chunk layer by layer, so the blender needs
    the loaded model. The worker must record it in :class:`lmcache_backend.model_tracker.
    ModelTracker` (and in LMCache's ``VLLMModelTracker`` when LMCache is installed) as soon as
    ``load_model`` has loaded it, and the KV-transfer connector — which looks the model up when it
    starts — must start only after that. vllm-ascend 0.9.1 to 0.13.0 start KV transfer in
    ``_init_worker_distributed_environment``, before the model exists.

How
    The worker file is parsed (``ast``); nothing is located by line number or text search.

    * At the end of ``NPUWorker.load_model`` a marked block is appended that registers
      ``self.model_runner.get_model()`` (the raw model: from 0.11.0 on ``model_runner.model`` may
      be an ``ACLGraphWrapper``, which hides the layers) under ``ENGINE_NAME``.
    * If the file starts KV transfer in ``_init_worker_distributed_environment`` (0.9.1, 0.11.0,
      0.13.0), that statement is commented out in place and the same call expression, byte for
      byte, is repeated at the end of the block, after the registration.
    * If the file starts it in ``initialize_from_config`` (0.18.0 on, with ``kv_cache_config`` as
      a second argument), which vLLM calls after ``load_model``, it is left alone: moving it
      would start it twice or without its second argument.

    The patched file records everything needed to restore the original bytes exactly (the block
    between markers, the commented-out statement after a fixed prefix), so no side file is kept.

Upstream version range
    Checked against the released vllm-ascend 0.9.1, 0.11.0, 0.13.0, 0.18.0, 0.23.0 and
    0.23.0.post1 (same worker as 0.23.0). Other versions are patched when their structure is one
    of the two above; anything else is refused with a message (see :class:`UnsupportedWorker`).
    The vLLM V0 worker (``worker.py`` of 0.9.1) is refused: CacheBlend runs on the V1 engine.

Removal plan
    Remove this patch when vllm-ascend exposes a hook after model loading that the
    ``vllm.general_plugins`` entry point of lmcache-backend can use on Ascend too (the runtime
    hook already covers vLLM on CUDA and CPU), and when no supported vllm-ascend release starts
    KV transfer before ``load_model``.
"""

from __future__ import annotations

import ast
import io
from dataclasses import dataclass
from typing import Literal

# The patched symbol, for messages.
SYMBOL = "vllm_ascend.worker.worker_v1.NPUWorker (worker.py from 0.13.0)"

KV_INIT_FUNC = "ensure_kv_transfer_initialized"
LOAD_METHOD = "load_model"
MODEL_LOAD_CALL = ("self", "model_runner", "load_model")
DIST_METHOD = "_init_worker_distributed_environment"
# vLLM's V1 engine calls this after load_model (the KV cache is sized from the loaded model), so
# KV transfer started here already starts after the registration.
AFTER_LOAD_METHOD = "initialize_from_config"

BEGIN_MARKER = "# >>> lmcache-backend: register the model for CacheBlend"
END_MARKER = "# <<< lmcache-backend"
MOVED_PREFIX = "# lmcache-backend moved to the end of load_model: "

Mode = Literal["move", "keep"]
State = Literal["patched", "unpatched"]


class UnsupportedWorker(Exception):
    """The file is not a vllm-ascend worker whose structure this patch understands."""


@dataclass(frozen=True)
class Analysis:
    """What an unpatched worker file needs.

    ``mode`` is ``"move"`` when KV transfer starts in ``_init_worker_distributed_environment``
    (it is moved to the end of ``load_model``) and ``"keep"`` when it already starts after the
    model is loaded. Line numbers are 1-based and inclusive.
    """

    class_name: str
    mode: Mode
    kv_method: str
    kv_call_source: str
    kv_stmt_lines: tuple[int, int]
    insert_after_line: int
    body_indent: str


# --------------------------------------------------------------------------------------------
# Parsing helpers


def split_lines(text: str) -> list[str]:
    """Split like the tokenizer does (``\\n``, ``\\r\\n``, ``\\r``), keeping the endings.

    ``str.splitlines`` also splits on form feeds and Unicode separators, which would shift
    ``ast`` line numbers.
    """
    return io.StringIO(text, newline="").readlines()


def _parse(text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError as exc:
        raise UnsupportedWorker(f"not valid Python ({exc.msg}, line {exc.lineno})") from exc


def _own_nodes(func: ast.AST) -> list[ast.AST]:
    """Nodes of ``func``'s body, not descending into nested functions, lambdas or classes."""
    found: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return found


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _is_attr_chain(node: ast.AST, chain: tuple[str, ...]) -> bool:
    """``node`` is ``chain[0].chain[1]...`` (a Name followed by attributes)."""
    for attr in reversed(chain[1:]):
        if not (isinstance(node, ast.Attribute) and node.attr == attr):
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == chain[0]


def _model_load_calls(func: ast.FunctionDef) -> list[ast.Call]:
    """Calls ``self.model_runner.load_model()`` inside ``func``."""
    return [
        n
        for n in _own_nodes(func)
        if isinstance(n, ast.Call) and _is_attr_chain(n.func, MODEL_LOAD_CALL)
    ]


def _is_kv_init_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == KV_INIT_FUNC) or (
        isinstance(f, ast.Attribute) and f.attr == KV_INIT_FUNC
    )


def find_worker_class(tree: ast.Module) -> ast.ClassDef:
    """The one top-level class whose ``load_model`` calls ``self.model_runner.load_model()``."""
    found = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and LOAD_METHOD in _methods(node)
        and _model_load_calls(_methods(node)[LOAD_METHOD])
    ]
    if len(found) != 1:
        raise UnsupportedWorker(
            f"expected one worker class whose {LOAD_METHOD}() calls "
            f"self.model_runner.load_model(), found {len(found)}"
        )
    return found[0]


# --------------------------------------------------------------------------------------------
# Analysis of an unpatched file


def _kv_calls_by_method(tree: ast.Module, cls: ast.ClassDef) -> list[tuple[str, ast.Call]]:
    """Every KV-transfer initialisation call in the file, with the method it sits in."""
    in_class: list[tuple[str, ast.Call]] = []
    for name, func in _methods(cls).items():
        in_class += [(name, n) for n in _own_nodes(func) if _is_kv_init_call(n)]
    total = sum(1 for n in ast.walk(tree) if _is_kv_init_call(n))
    if total != len(in_class):
        raise UnsupportedWorker(
            f"{KV_INIT_FUNC}() is called outside the methods of {cls.name}; "
            "cannot tell when KV transfer starts"
        )
    return in_class


def _check_movable(func: ast.FunctionDef, call: ast.Call, lines: list[str]) -> ast.Expr:
    """The statement holding ``call`` if it can be moved verbatim into ``load_model``."""
    stmt = next((s for s in func.body if isinstance(s, ast.Expr) and s.value is call), None)
    if stmt is None:
        raise UnsupportedWorker(
            f"{KV_INIT_FUNC}() in {DIST_METHOD}() is not a plain statement of its body "
            "(conditional or part of an expression); moving it would change its meaning"
        )
    local_names = sorted(
        {n.id for n in ast.walk(call) if isinstance(n, ast.Name) and n.id != "self"}
        - {KV_INIT_FUNC}
    )
    if local_names:
        raise UnsupportedWorker(
            f"{KV_INIT_FUNC}() in {DIST_METHOD}() uses {', '.join(local_names)}, which "
            f"{LOAD_METHOD}() does not have; this looks like the vLLM V0 worker (vllm-ascend "
            "0.9.1 worker.py). CacheBlend runs on the V1 engine: patch worker_v1.py"
        )
    first, last = lines[stmt.lineno - 1], lines[stmt.end_lineno - 1]
    after = last.encode("utf-8")[stmt.end_col_offset :].decode("utf-8").strip()
    if first[: stmt.col_offset].strip() or (after and not after.startswith("#")):
        raise UnsupportedWorker(
            f"{KV_INIT_FUNC}() in {DIST_METHOD}() shares its line with other code"
        )
    if len(func.body) == 1:
        raise UnsupportedWorker(f"{DIST_METHOD}() holds nothing but {KV_INIT_FUNC}()")
    return stmt


def _check_load_model(func: ast.FunctionDef, lines: list[str]) -> tuple[int, str]:
    """Line after which to append the block, and the body indentation of ``load_model``."""
    for node in _own_nodes(func):
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)):
            raise UnsupportedWorker(
                f"{LOAD_METHOD}() can return early (line {node.lineno}); code appended at its "
                "end would not always run"
            )
    last = func.body[-1]
    end_line = last.end_lineno
    if not lines[end_line - 1].endswith(("\n", "\r")):
        raise UnsupportedWorker(f"{LOAD_METHOD}() ends the file without a line break")
    indent = lines[last.lineno - 1][: last.col_offset]
    if indent.strip() or not indent:
        raise UnsupportedWorker(f"cannot tell the indentation of {LOAD_METHOD}()")
    return end_line, indent


def analyse_unpatched(text: str) -> Analysis:
    """Work out what an unpatched worker file needs; raise :class:`UnsupportedWorker` if unsure."""
    tree = _parse(text)
    lines = split_lines(text)
    cls = find_worker_class(tree)
    methods = _methods(cls)
    kv_calls = _kv_calls_by_method(tree, cls)
    if any(m == LOAD_METHOD for m, _ in kv_calls):
        raise UnsupportedWorker(
            f"{LOAD_METHOD}() already starts KV transfer: the file was changed by hand or by "
            "another patcher (such as LMCache-Ascend's apply_patch.py); restore the released "
            "file (pip install --force-reinstall --no-deps vllm-ascend==<version>) and run again"
        )
    if len(kv_calls) != 1:
        where = ", ".join(f"{m}()" for m, _ in kv_calls) or "nowhere"
        raise UnsupportedWorker(
            f"expected {KV_INIT_FUNC}() exactly once in {cls.name}, found it in {where}"
        )
    method, call = kv_calls[0]
    segment = ast.get_source_segment(text, call) or ""
    source = segment if "\n" not in segment else ast.unparse(call)
    insert_after, indent = _check_load_model(methods[LOAD_METHOD], lines)
    if method == DIST_METHOD:
        stmt = _check_movable(methods[DIST_METHOD], call, lines)
        span = (stmt.lineno, stmt.end_lineno)
        mode: Mode = "move"
    elif method == AFTER_LOAD_METHOD:
        span, mode = (call.lineno, call.end_lineno), "keep"
    else:
        raise UnsupportedWorker(
            f"KV transfer starts in {method}(); this patch knows only {DIST_METHOD}() (moved "
            f"after the model load) and {AFTER_LOAD_METHOD}() (already after it)"
        )
    return Analysis(cls.name, mode, method, source, span, insert_after, indent)


# --------------------------------------------------------------------------------------------
# The inserted code


def registration_block(indent: str, newline: str, kv_call_source: str | None) -> list[str]:
    """Lines appended to ``load_model``; ``kv_call_source`` is repeated last when given."""
    body = [
        BEGIN_MARKER + " (undo: apply-patch --revert)",
        "from lmcache_backend.model_tracker import ENGINE_NAME as _lmcb_engine_name",
        "from lmcache_backend.model_tracker import ModelTracker as _LmcbModelTracker",
        "_lmcb_model = self.model_runner.get_model()  # unwrapped from any graph wrapper",
        "_LmcbModelTracker.register_model(_lmcb_engine_name, _lmcb_model)",
        "try:  # LMCache is optional; when installed, its blender looks the model up too",
        "    from lmcache.integration.vllm.utils import ENGINE_NAME as _lmc_engine_name",
        "    from lmcache.v1.compute.models.utils import VLLMModelTracker as _LmcModelTracker",
        "except ImportError:",
        "    pass",
        "else:",
        "    _LmcModelTracker.register_model(_lmc_engine_name, _lmcb_model)",
    ]
    if kv_call_source is not None:
        body += [
            f"# KV transfer starts after the registration (moved from {DIST_METHOD})",
            kv_call_source,
        ]
    body.append(END_MARKER)
    return [indent + line + newline for line in body]


def _newline_of(line: str) -> str:
    return line[len(line.rstrip("\r\n")) :] or "\n"


# --------------------------------------------------------------------------------------------
# Apply, revert, status


def _strip_patch(text: str) -> str:
    """Remove the appended block and un-comment the moved statement (no validation)."""
    out: list[str] = []
    in_block = False
    for line in split_lines(text):
        stripped = line.lstrip(" \t")
        if stripped.startswith(BEGIN_MARKER):
            in_block = True
        if not in_block:
            if stripped.startswith(MOVED_PREFIX):
                indent = line[: len(line) - len(stripped)]
                line = indent + stripped[len(MOVED_PREFIX) :]
            out.append(line)
        if in_block and stripped.rstrip("\r\n") == END_MARKER:
            in_block = False
    return "".join(out)


def _marker_counts(text: str) -> tuple[int, int, int]:
    begin = end = moved = 0
    for line in split_lines(text):
        stripped = line.lstrip(" \t")
        begin += stripped.startswith(BEGIN_MARKER)
        end += stripped.rstrip("\r\n") == END_MARKER
        moved += stripped.startswith(MOVED_PREFIX)
    return begin, end, moved


def _build(text: str, plan: Analysis) -> str:
    lines = split_lines(text)
    newline = _newline_of(lines[plan.insert_after_line - 1])
    moved = plan.mode == "move"
    block = registration_block(plan.body_indent, newline, plan.kv_call_source if moved else None)
    if moved:
        start, end = plan.kv_stmt_lines
        for i in range(start - 1, end):
            indent = lines[start - 1][: len(lines[start - 1]) - len(lines[start - 1].lstrip())]
            if not lines[i].startswith(indent):
                raise UnsupportedWorker(f"{KV_INIT_FUNC}() statement is oddly indented")
            lines[i] = indent + MOVED_PREFIX + lines[i][len(indent) :]
    at = plan.insert_after_line
    return "".join(lines[:at] + block + lines[at:])


def _verify_patched(text: str, new: str, plan: Analysis, path: str) -> None:
    """Refuse to hand back a patched text that does not compile or does not revert exactly."""
    try:
        compile(new, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise UnsupportedWorker(f"the patched file would not compile: {exc}") from exc
    if _strip_patch(new) != text:
        raise UnsupportedWorker("the patch would not revert to the original bytes; refusing")
    tree = _parse(new)
    cls = find_worker_class(tree)
    expected = LOAD_METHOD if plan.mode == "move" else plan.kv_method
    if [m for m, _ in _kv_calls_by_method(tree, cls)] != [expected]:
        raise UnsupportedWorker("the patched file would not start KV transfer exactly once")


def status(text: str) -> tuple[State, Analysis]:
    """Whether ``text`` carries this patch, with the analysis of its unpatched form.

    Raises:
        UnsupportedWorker: not a worker this patch understands, or a partly patched file.
    """
    begin, end, moved = _marker_counts(text)
    if (begin, end, moved) == (0, 0, 0):
        return "unpatched", analyse_unpatched(text)
    if begin != 1 or end != 1 or moved > 1:
        raise UnsupportedWorker(
            "the file is partly patched (markers of lmcache-backend found in unexpected "
            "numbers); reinstall vllm-ascend to get a clean file"
        )
    original = _strip_patch(text)
    plan = analyse_unpatched(original)
    if (plan.mode == "move") != (moved == 1):
        raise UnsupportedWorker("the file is partly patched; reinstall vllm-ascend")
    _check_block_inside_load_model(text)
    return "patched", plan


def _check_block_inside_load_model(text: str) -> None:
    tree = _parse(text)
    func = _methods(find_worker_class(tree))[LOAD_METHOD]
    begin = next(
        i
        for i, line in enumerate(split_lines(text), 1)
        if line.lstrip(" \t").startswith(BEGIN_MARKER)
    )
    load_line = max(c.lineno for c in _model_load_calls(func))
    if not load_line < begin <= func.end_lineno:
        raise UnsupportedWorker(
            f"the lmcache-backend block is not at the end of {LOAD_METHOD}(); reinstall vllm-ascend"
        )


def apply(text: str, path: str = "<worker>") -> str:
    """The patched text (``text`` itself when it already carries the current patch).

    A file patched by an older lmcache-backend (a different block) is brought up to date.
    """
    state, plan = status(text)
    original = text if state == "unpatched" else _strip_patch(text)
    new = _build(original, plan)
    _verify_patched(original, new, plan, path)
    return new


def revert(text: str) -> str:
    """The original text of a patched file (``text`` itself when it is not patched)."""
    state, _ = status(text)  # also checks that the stripped text is an understood worker
    return text if state == "unpatched" else _strip_patch(text)
