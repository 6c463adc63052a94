#!/usr/bin/env python3
"""Record what each vLLM / vllm-ascend release hands a KV connector, from the released packages.

The packages are read, never installed or imported: each release is downloaded with
``pip download --no-deps`` (a vllm-ascend release published only as an sdist is fetched from the
simple index pip uses), its Python sources are copied into a small zip under ``--cache`` and the
wheel is deleted.
The sources are then parsed with ``ast`` and one JSON fixture per release is written to ``--out``,
plus ``index.json``. Facts read mechanically carry ``"source": "path::Qualname"``; the few facts
that need reading code as a whole come from :data:`ANNOTATIONS` below, each with its source.

Usage::

    python tools/record_engine_contracts.py                  # every release in RELEASES
    python tools/record_engine_contracts.py --only vllm==0.32.0 --only vllm-ascend==0.18.0
    python tools/record_engine_contracts.py --wheel-dir DIR  # local wheels / sdists, no download

Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1

#: Releases recorded by default. vLLM: 0.9.2, the last patch of each minor from 0.10 on, plus
#: 0.10.0 and 0.11.0, where the LMCache matrix has rows, and 0.9.1, which vllm-ascend 0.9.1 pins.
RELEASES: dict[str, list[str]] = {
    "vllm": [
        "0.9.1", "0.9.2", "0.10.0", "0.10.2", "0.11.0", "0.11.2", "0.12.0", "0.13.0", "0.14.1",
        "0.15.1", "0.16.0", "0.17.1", "0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0",
        "0.24.0", "0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
        "0.33.0",
    ],
    "vllm-ascend": ["0.9.1", "0.11.0", "0.13.0", "0.18.0", "0.23.0.post1"],
}  # fmt: skip

#: The CUDA wheels of vLLM carry one of these platform tags, depending on the release.
VLLM_PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux1_x86_64",
]
SIMPLE_INDEX = "https://pypi.org/simple/{name}/"

# --------------------------------------------------------------------------------------------
# Manual annotations: facts read from code as a whole (data flow across functions), which the
# extractors below do not derive. Each applies to a closed range of releases and names its source.

ANNOTATIONS: list[dict[str, Any]] = [
    {
        "package": "vllm",
        "range": ("0.9.2", "0.28.0"),
        "key": "registered_tensor",
        "fact": "register_kv_caches gets, per layer, the tensor _reshape_kv_cache_tensors builds: "
        "the layer's int8 buffer viewed as the spec dtype and as get_kv_cache_shape(...) "
        "permuted by get_kv_cache_stride_order(), then permuted back with .permute(*inv_order). "
        "So its shape is get_kv_cache_shape(...) and its memory order is the stride order "
        "(attention_backends.*.registered_tensor). From 0.11.2 the shape is computed for kernel "
        "blocks: num_blocks * (block_size // kernel_block_size) blocks of kernel_block_size "
        "tokens, where the backend's supported kernel block sizes exclude the manager's.",
        "source": "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._reshape_kv_cache_tensors",
    },
    {
        "package": "vllm",
        "range": ("0.12.0", "0.28.0"),
        "key": "cross_layer",
        "fact": "If the connector's prefer_cross_layer_blocks is True (a ClassVar in 0.12-0.13, a "
        "property from 0.14; False in the base class), the model has one attention group and "
        "the backend's get_kv_cache_stride_order(include_num_layers_dimension=True) has a layers "
        "dim, one buffer holds all layers (allocate_uniform_kv_caches) and the runner calls "
        "register_cross_layers_kv_cache(tensor, backend) instead of register_kv_caches.",
        "source": "vllm/v1/worker/kv_connector_model_runner_mixin.py::"
        "KVConnectorModelRunnerMixin.use_uniform_kv_cache",
    },
    {
        "package": "vllm",
        "range": ("0.29.0", "0.33.0"),
        "key": "registered_tensor",
        "fact": "register_kv_caches gets allocate_kv_cache's dict: per layer a 4-D view "
        "[B, H, N, C] = [num_blocks, num_kv_heads, block_size, head_size + head_size_v] of one "
        "int8 backing buffer (torch.as_strided, then .view(spec.dtype)), whose memory order is "
        "KVCacheLayout.layer_view_order of the resolved layout (LBNHC by default: memory "
        "[num_blocks, block_size, num_kv_heads, 2*head_size], not contiguous as [B, H, N, C]). "
        "FLASH_ATTN/FLASHINFER/TRITON_ATTN read K as C[:head_size] and V as C[head_size:] of each "
        "token; CPU_ATTN reads a (block, head) slab as [2*block_size, head_size], K rows then V "
        "rows (kv_read). B and N count kernel blocks when the backend "
        "splits manager blocks (kernel_block_sizes). The V1 and V2 runners both hand over "
        "these views; from 0.32 map_kv_caches_to_kernel_blocks re-views packed caches for the "
        "layers only.",
        "source": "vllm/v1/worker/utils.py::allocate_kv_cache + "
        "vllm/v1/kv_cache_interface.py::create_kv_cache_views",
    },
    {
        "package": "vllm",
        "range": ("0.29.0", "0.33.0"),
        "key": "cross_layer",
        "fact": "register_cross_layers_kv_cache and prefer_cross_layer_blocks are gone. Every "
        "KVCacheTensor puts its layers in one backing allocation (layer_stride, block_stride); "
        "with a block-outer layout (BLHNC, BLNHC, BHLNC: by VLLM_KV_CACHE_LAYOUT, the "
        "connector's get_required_kvcache_layout, or FlashInfer on SM100 offering BLHNC) a "
        "layer's block stride spans all layers of its tensor.",
        "source": "vllm/v1/kv_cache_interface.py::create_kv_cache_views",
    },
    {
        "package": "vllm",
        "range": ("0.9.2", "0.33.0"),
        "key": "register_kv_caches_keys",
        "fact": "Keys are the attention layers' prefixes, e.g. 'model.layers.0.self_attn.attn' "
        "for Llama/Qwen; a layer sharing another's KV cache (cross-layer KV sharing) maps to "
        "that layer's tensor.",
        "source": "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.initialize_kv_cache_tensors",
    },
    {
        "package": "vllm-ascend",
        "range": ("0.9.1", "0.9.1"),
        "key": "registered_tensor",
        "fact": "Non-MLA layer: a list [k_cache, v_cache], each get_kv_cache_shape(...)[1:] = "
        "[num_blocks, block_size, num_kv_heads, head_size] of kv_cache_spec.dtype, each its own "
        "2 MiB-aligned allocation. MLA: a tuple (nope_cache, rope_cache).",
        "source": "vllm_ascend/worker/model_runner_v1.py::NPUModelRunner.initialize_kv_cache",
    },
    {
        "package": "vllm-ascend",
        "range": ("0.11.0", "0.11.0"),
        "key": "registered_tensor",
        "fact": "Full attention: a tuple (k_cache, v_cache), each get_kv_cache_shape(...)[1:] = "
        "[num_blocks, block_size, num_kv_heads, head_size] of kv_cache_spec.dtype: two int8 "
        "allocations (2 MiB aligned when a KV transfer config is set), each through "
        "_convert_torch_format (npu_format_cast to ACL_FORMAT: FRACTAL_NZ on 310P, else ND). On "
        "310P the shape is [num_blocks, num_kv_heads*head_size//16, block_size, 16]; with "
        "additional_config kv_cache_dtype=int8 it is get_bsh_kv_cache_shape; with hybrid "
        "blocks num_blocks/block_size are the kernel's (get_supported_block_size).",
        "source": "vllm_ascend/worker/model_runner_v1.py::NPUModelRunner."
        "initialize_kv_cache_tensors",
    },
    {
        "package": "vllm-ascend",
        "range": ("0.13.0", "0.23.0.post1"),
        "key": "registered_tensor",
        "fact": "Full attention: a tuple (k_cache, v_cache), each [num_blocks, block_size, "
        "num_kv_heads, head_size] (get_kv_cache_shape(...)[1:]; from 0.18.0 V uses "
        "head_size_v when the spec has it), views of two separate int8 allocations; "
        "sparse/DSA models append indexer caches to the tuple. dtype: kv_cache_spec.dtype; "
        "the quant config's KV dtype (int8) when enable_fa_quant holds (0.18.0: only on a KV "
        "consumer). With hybrid blocks num_blocks/block_size are the kernel's.",
        "source": "vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._reshape_kv_cache_tensors",
    },
]

# --------------------------------------------------------------------------------------------
# Versions


def vkey(version: str) -> tuple:
    """Sort key of ``X.Y.Z`` with an optional ``.postN`` / ``rcN``."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?", version)
    if not m:
        raise ValueError(f"unparsable version {version!r}")
    major, minor, patch, extra, post = m.groups()
    return (int(major), int(minor), int(patch), int(extra or 0), int(post or 0))


def in_range(version: str, lo: str, hi: str) -> bool:
    return vkey(lo) <= vkey(version) <= vkey(hi)


# --------------------------------------------------------------------------------------------
# Fetching: a slim zip of the Python sources per release


def dist_name(package: str) -> str:
    return package.replace("-", "_")


def slim_path(cache: Path, package: str, version: str) -> Path:
    return cache / f"{dist_name(package)}-{version}.src.zip"


def write_slim(artifact: Path, slim: Path, package: str) -> None:
    """Copy the package's ``.py`` files (and metadata) of a wheel or sdist into ``slim``."""
    top = dist_name(package)
    files: dict[str, bytes] = {}
    if artifact.name.endswith(".whl"):
        with zipfile.ZipFile(artifact) as zf:
            for name in zf.namelist():
                if (name.startswith(top + "/") and name.endswith(".py")) or (
                    name.count("/") == 1 and name.endswith(".dist-info/METADATA")
                ):
                    files[name] = zf.read(name)
    elif artifact.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(artifact) as tf:
            for member in tf.getmembers():
                if not member.isfile():
                    continue
                name = member.name.split("/", 1)[1] if "/" in member.name else member.name
                if name in ("PKG-INFO", "Dockerfile", "requirements.txt") or (
                    name.startswith(top + "/") and name.endswith(".py")
                ):
                    extracted = tf.extractfile(member)
                    assert extracted is not None
                    files[name] = extracted.read()
    else:
        raise ValueError(f"not a wheel or sdist: {artifact}")
    meta = {"artifact": artifact.name, "sha256": hashlib.sha256(artifact.read_bytes()).hexdigest()}
    files["__artifact__.json"] = json.dumps(meta, sort_keys=True).encode()
    slim.parent.mkdir(parents=True, exist_ok=True)
    tmp = slim.with_suffix(".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(info, files[name])
    tmp.replace(slim)


def pip_download(package: str, version: str, dest: Path) -> Path | None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    if package == "vllm":
        cmd += ["--only-binary=:all:", "--python-version", "3.11"]
        for platform in VLLM_PLATFORMS:
            cmd += ["--platform", platform]
    else:
        cmd += ["--only-binary=:all:"]
    cmd.append(f"{package}=={version}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.iterdir())
    if proc.returncode != 0 or not found:
        return None
    return found[0]


def sdist_download(package: str, version: str, dest: Path) -> Path:
    """The release's sdist, from the PEP 691 simple index (pip would try to build it)."""
    req = urllib.request.Request(
        SIMPLE_INDEX.format(name=package),
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        index = json.load(resp)
    wanted = f"{dist_name(package)}-{version}.tar.gz"
    entry = next((f for f in index["files"] if f["filename"] == wanted), None)
    if entry is None:
        raise RuntimeError(f"{package}=={version}: no wheel for this platform and no {wanted}")
    with urllib.request.urlopen(entry["url"], timeout=600) as resp:
        data = resp.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{wanted}: sha256 mismatch")
    path = dest / wanted
    path.write_bytes(data)
    return path


def fetch(package: str, version: str, cache: Path, wheel_dir: Path | None, tmp_root: Path) -> Path:
    """The slim source zip of a release, downloading the release if it is not cached."""
    slim = slim_path(cache, package, version)
    if slim.exists():
        return slim
    if wheel_dir is not None:
        prefix = f"{dist_name(package)}-{version}"
        found = sorted(
            p
            for p in wheel_dir.iterdir()
            if p.name.startswith(prefix + "-") or p.name in (prefix + ".tar.gz",)
        )
        if not found:
            raise RuntimeError(f"no {prefix}-*.whl or {prefix}.tar.gz in {wheel_dir}")
        write_slim(found[0], slim, package)
        return slim
    tmp_root.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix=f"{dist_name(package)}-{version}-", dir=tmp_root))
    try:
        artifact = pip_download(package, version, dest)
        if artifact is None:
            if package == "vllm":
                raise RuntimeError(f"pip download vllm=={version} found no CUDA wheel")
            artifact = sdist_download(package, version, dest)
        write_slim(artifact, slim, package)
    finally:
        shutil.rmtree(dest, ignore_errors=True)  # the wheel is not kept
    return slim


# --------------------------------------------------------------------------------------------
# Reading sources


class Sources:
    """The Python sources of one release (a slim zip), parsed on demand."""

    def __init__(self, slim: Path) -> None:
        self.zf = zipfile.ZipFile(slim)
        self.names = set(self.zf.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def artifact(self) -> dict[str, str]:
        return json.loads(self.zf.read("__artifact__.json"))

    def text(self, path: str) -> str | None:
        if path not in self.names:
            return None
        return self.zf.read(path).decode("utf-8-sig", errors="replace")

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            text = self.text(path)
            try:
                self._trees[path] = ast.parse(text) if text is not None else None
            except SyntaxError:  # a file of another Python version; not one we read
                self._trees[path] = None
        return self._trees[path]

    def glob(self, prefix: str, suffix: str = ".py") -> list[str]:
        return sorted(n for n in self.names if n.startswith(prefix) and n.endswith(suffix))


FuncDef = (ast.FunctionDef, ast.AsyncFunctionDef)


def find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def class_method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    for node in cls.body:
        if isinstance(node, FuncDef) and node.name == name:
            return node  # type: ignore[return-value]
    return None


def find_def(tree: ast.Module | None, qualname: str) -> ast.AST | None:
    """``func``, ``Class`` or ``Class.method`` at module level."""
    if tree is None:
        return None
    head, _, rest = qualname.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, *FuncDef)) and node.name == head:
            if not rest:
                return node
            if isinstance(node, ast.ClassDef):
                return class_method(node, rest)
    return None


def decorators(fn: ast.AST) -> list[str]:
    names = []
    for dec in getattr(fn, "decorator_list", []):
        target = dec.func if isinstance(dec, ast.Call) else dec
        names.append(ast.unparse(target).split(".")[-1])
    return names


def params(fn: ast.AST) -> list[str]:
    """Parameters as written (``name`` or ``name=default``, ``*args``, ``**kw``), without the
    leading ``self``/``cls`` of a method."""
    a = fn.args  # type: ignore[attr-defined]
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for arg, default in zip(positional, defaults):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if out and out[0] in ("self", "cls") and "staticmethod" not in decorators(fn):
        out = out[1:]
    if a.vararg:
        out.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        out.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.kwarg:
        out.append(f"**{a.kwarg.arg}")
    return out


def own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a function body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*FuncDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def call_name(call: ast.Call) -> str:
    return ast.unparse(call.func).split(".")[-1]


def class_attribute(tree: ast.Module | None, cls_name: str, attr: str, seen=()) -> str | None:
    """The class (of this file) declaring ``attr``: in its body, or ``self.<attr> = ...`` in one
    of its methods, following base classes defined in the same file."""
    cls = find_class(tree, cls_name)
    if cls is None or cls_name in seen:
        return None
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == attr:
            return cls_name
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == attr for t in node.targets):
            return cls_name
        if isinstance(node, FuncDef) and node.name == attr:
            return cls_name
    for node in ast.walk(cls):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr == attr:
                    if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        return cls_name
    for base in cls.bases:
        found = class_attribute(tree, ast.unparse(base).split(".")[-1], attr, (*seen, cls_name))
        if found:
            return found
    return None


def src(path: str, qualname: str) -> str:
    return f"{path}::{qualname}"


# --------------------------------------------------------------------------------------------
# Symbolic evaluation of small functions (get_kv_cache_shape, get_kv_cache_stride_order, ...)


def returns(body: list[ast.stmt], conds: tuple[str, ...] = ()) -> Iterator[tuple]:
    """``(conditions, value)`` of every return statement in source order, with the if-tests
    enclosing it (``not (...)`` in an else branch). A return applies when its tests hold and no
    earlier one was taken; a branch that only raises is a validity check and is skipped."""
    for stmt in body:
        if isinstance(stmt, ast.Return):
            yield conds, stmt.value
            return
        if isinstance(stmt, ast.If) and stmt.body and isinstance(stmt.body[-1], ast.Raise):
            if not stmt.orelse:
                continue
        if isinstance(stmt, ast.If):
            test = ast.unparse(stmt.test)
            yield from returns(stmt.body, (*conds, test))
            yield from returns(stmt.orelse, (*conds, f"not ({test})"))
        elif isinstance(stmt, (ast.With, ast.For, ast.While)):
            yield from returns(stmt.body, conds)
        elif isinstance(stmt, ast.Try):
            yield from returns(stmt.body, conds)


def shape_dims(value: ast.AST | None, fn: ast.AST) -> list[str] | str | None:
    if value is None:
        return None
    if isinstance(value, ast.Name):  # a local assigned once from a tuple
        for node in own_nodes(fn):
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [
                value.id
            ]:
                value = node.value
                break
    if isinstance(value, ast.Tuple):
        return [ast.unparse(e) for e in value.elts]
    if isinstance(value, ast.Constant):
        return value.value
    return ast.unparse(value)


def returned_shapes(fn: ast.AST | None, s: Sources | None = None) -> list[dict[str, Any]]:
    """The shapes a function returns; ``X.get_kv_cache_shape(...)`` delegations are followed
    (one level) into ``vllm/attention/ops`` / ``vllm/v1/attention/ops``."""
    if fn is None:
        return []
    out = []
    for conds, value in returns(fn.body):  # type: ignore[attr-defined]
        entry: dict[str, Any] = {"dims": shape_dims(value, fn), "when": " and ".join(conds) or None}
        if s is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            owner = ast.unparse(value.func.value)
            for path in s.glob("vllm/attention/ops/") + s.glob("vllm/v1/attention/ops/"):
                target = find_def(s.tree(path), f"{owner}.{value.func.attr}")
                if target is not None:
                    entry["delegate"] = {
                        "returns": returned_shapes(target),
                        "source": src(path, f"{owner}.{value.func.attr}"),
                    }
                    break
        out.append(entry)
    return out


class Unknown(Exception):
    pass


def _eval(node: ast.AST, env: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_eval(e, env) for e in node.elts)
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise Unknown(node.id)
    if isinstance(node, ast.Call) and call_name(node) == "get_kv_cache_layout":
        return env["__layout__"]
    if isinstance(node, ast.BoolOp):
        vals = [_eval(v, env) for v in node.values]
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _eval(node.operand, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = _eval(node.left, env), _eval(node.comparators[0], env)
        op = node.ops[0]
        if isinstance(op, ast.Eq):
            return left == right
        if isinstance(op, ast.NotEq):
            return left != right
        if isinstance(op, ast.In):
            return left in right
        if isinstance(op, ast.Is):
            return left is right
        if isinstance(op, ast.IsNot):
            return left is not right
    raise Unknown(ast.unparse(node))


def _run(body: list[ast.stmt], env: dict[str, Any]) -> Any:
    for stmt in body:
        if isinstance(stmt, ast.Return):
            return ("return", _eval(stmt.value, env) if stmt.value else None)
        if isinstance(stmt, ast.Raise):
            return ("raise", None)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                try:
                    env[target.id] = _eval(stmt.value, env)
                except Unknown:
                    env.pop(target.id, None)
            continue
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if stmt.value is not None:
                try:
                    env[stmt.target.id] = _eval(stmt.value, env)
                except Unknown:
                    env.pop(stmt.target.id, None)
            continue
        if isinstance(stmt, ast.If):
            result = _run(stmt.body if _eval(stmt.test, env) else stmt.orelse, env)
            if result is not None:
                return result
            continue
        if isinstance(stmt, (ast.Expr, ast.Pass, ast.Global, ast.ImportFrom, ast.Import)):
            continue
        raise Unknown(ast.unparse(stmt)[:80])
    return None


def stride_orders(fn: ast.AST | None) -> dict[str, Any] | None:
    """get_kv_cache_stride_order evaluated for NHD/HND, with and without a layers dim."""
    if fn is None:
        return None
    names = params(fn)
    out: dict[str, Any] = {"params": names}
    cases = [("NHD", False), ("HND", False)]
    if any(p.startswith("include_num_layers_dimension") for p in names):
        cases += [("NHD", True), ("HND", True)]
    for layout, layers in cases:
        env = {"__layout__": layout, "include_num_layers_dimension": layers}
        try:
            result = _run(list(fn.body), env)  # type: ignore[attr-defined]
        except Unknown as exc:
            out[layout + ("_cross_layer" if layers else "")] = f"unevaluated: {exc}"
            continue
        kind, value = result if result else ("none", None)
        key = layout + ("_cross_layer" if layers else "")
        out[key] = list(value) if kind == "return" and isinstance(value, tuple) else kind
    return out


# --------------------------------------------------------------------------------------------
# vLLM extractors

BACKENDS_DIR = "vllm/v1/attention/backends/"
BACKEND_FILES = {
    "FLASH_ATTN": "flash_attn.py",
    "FLASHINFER": "flashinfer.py",
    "TRITON_ATTN": "triton_attn.py",
    "CPU_ATTN": "cpu_attn.py",
}
KV_NAMES = {"kv_cache", "kv_cache_permute", "kv_cache_layer"}
WORKER_DIR = "vllm/v1/worker/"


def backend_class(tree: ast.Module) -> ast.ClassDef | None:
    for node in tree.body:
        if (
            isinstance(node, ast.ClassDef)
            and node.name.endswith("Backend")
            and class_method(node, "get_name") is not None
        ):
            return node
    return None


def impl_class_name(backend: ast.ClassDef) -> str | None:
    fn = class_method(backend, "get_impl_cls")
    if fn is None:
        return None
    for _, value in returns(fn.body):
        if isinstance(value, ast.Name):
            return value.id
    return None


KV_OPS = {"unbind", "split", "permute", "transpose", "view", "chunk", "flatten", "unflatten"}


def target_text(node: ast.AST) -> str:
    """An assignment target, a tuple without parentheses."""
    if isinstance(node, ast.Tuple):
        return ", ".join(ast.unparse(e) for e in node.elts)
    return ast.unparse(node)


def _rooted_at_kv_cache(node: ast.AST) -> bool:
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id == "kv_cache"


def kv_reads(tree: ast.Module, impl_name: str | None, path: str) -> list[dict[str, str]]:
    """How the backend's implementation takes K and V (or a view of both) out of the layer's
    ``kv_cache``: the outermost ``kv_cache.<op>(...)`` chains, with their assignment target."""
    cls = find_class(tree, impl_name) if impl_name else None
    if cls is None:
        return []
    found: dict[str, str] = {}
    for fn in cls.body:
        if not isinstance(fn, FuncDef):
            continue
        for stmt in sorted(
            (n for n in own_nodes(fn) if isinstance(n, ast.stmt)), key=lambda n: n.lineno
        ):
            for node in ast.iter_child_nodes(stmt):
                for sub in ast.walk(node):
                    if (
                        isinstance(sub, ast.Call)
                        and isinstance(sub.func, ast.Attribute)
                        and sub.func.attr in KV_OPS
                        and _rooted_at_kv_cache(sub)
                    ):
                        text = ast.unparse(sub)
                        if isinstance(stmt, ast.Assign) and stmt.value is sub:
                            text = " = ".join(map(target_text, stmt.targets)) + " = " + text
                        found.setdefault(text, src(path, f"{cls.name}.{fn.name}"))
    codes = list(found)
    outer = [c for c in codes if not any(c != o and c in o for o in codes)]
    return [{"code": c, "source": found[c]} for c in outer[:8]]


def layout_returns(fn: ast.AST | None) -> list[dict[str, Any]]:
    out = []
    if fn is None:
        return out
    for conds, value in returns(fn.body):  # type: ignore[attr-defined]
        if isinstance(value, ast.Tuple):
            val: Any = [ast.unparse(e).split(".")[-1] for e in value.elts]
        else:
            val = ast.unparse(value) if value is not None else None
        out.append({"value": val, "when": " and ".join(conds) or None})
    return out


def kv_cache_layout_enum(s: Sources) -> dict[str, Any] | None:
    """The 0.29+ KVCacheLayout enum: each member's stride order over [L, B, H, N, C] and the
    per-layer view order derived from it."""
    path = "vllm/v1/kv_cache_layout.py"
    cls = find_class(s.tree(path), "KVCacheLayout")
    if cls is None:
        return None
    prop = class_method(cls, "layer_view_order")
    formula = ast.unparse(prop.body[-1]) if prop is not None else None
    expected = "return tuple((i - 1 for i in self.value if i != _DIM_L))"
    members = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            order = [e.value for e in node.value.elts]  # type: ignore[attr-defined]
            entry: dict[str, Any] = {"stride_order_LBHNC": order}
            if formula == expected:
                entry["layer_view_order_BHNC"] = [i - 1 for i in order if i != 0]
            members[ast.unparse(node.targets[0])] = entry
    return {
        "members": members,
        "layer_view_order_formula": formula,
        "source": src(path, "KVCacheLayout"),
    }


def layout_selection(s: Sources) -> dict[str, Any]:
    """How the layout of the KV cache is chosen."""
    utils = BACKENDS_DIR + "utils.py"
    out: dict[str, Any] = {}
    tree = s.tree(utils)
    resolve = find_def(tree, "resolve_kv_cache_layout")
    if resolve is not None:
        out["resolver"] = src(utils, "resolve_kv_cache_layout")
        for node in tree.body:  # type: ignore[union-attr]
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == (
                "_DEFAULT_LAYOUT_PREFERENCE"
            ):
                out["default_preference"] = [
                    ast.unparse(e).split(".")[-1]
                    for e in node.value.elts  # type: ignore[attr-defined]
                ]
        alias = find_def(tree, "_layout_from_name")
        if alias is not None:
            out["legacy_aliases"] = {
                m.group(1): m.group(2)
                for m in re.finditer(r"'(NHD|HND)': KVCacheLayout\.(\w+)", ast.unparse(alias))
            }
        text = ast.unparse(resolve)
        out["order"] = [
            step
            for step, marker in (
                ("cache_config.kv_cache_layout", "cache_config.kv_cache_layout is not None"),
                ("envs.VLLM_KV_CACHE_LAYOUT", "VLLM_KV_CACHE_LAYOUT"),
                ("connector.get_required_kvcache_layout", "get_kv_connector_cache_layout"),
                ("candidates[0]", "candidates[0]"),
            )
            if marker in text
        ]
        out["enum"] = kv_cache_layout_enum(s)
        return out
    fn = find_def(tree, "get_kv_cache_layout")
    if fn is not None:
        text = ast.unparse(fn)
        out["resolver"] = src(utils, "get_kv_cache_layout")
        out["order"] = [
            step
            for step, marker in (
                ("set_kv_cache_layout override", "_KV_CACHE_LAYOUT_OVERRIDE"),
                ("envs.VLLM_KV_CACHE_LAYOUT", "VLLM_KV_CACHE_LAYOUT"),
                ("connector.get_required_kvcache_layout", "get_kv_connector_cache_layout"),
            )
            if marker in text
        ]
    for path in s.glob("vllm/distributed/kv_transfer/kv_connector/utils.py"):
        fn = find_def(s.tree(path), "get_kv_connector_cache_layout")
        if fn is not None:
            consts = [
                r["value"] for r in layout_returns(fn) if isinstance(r["value"], str)
            ]  # e.g. "'NHD'"
            out["default"] = consts[-1].strip("'\"") if consts else None
            out["default_source"] = src(path, "get_kv_connector_cache_layout")
    forced = []
    for path in sorted(s.glob("vllm/platforms/") + s.glob("vllm/attention/selector.py")) + s.glob(
        "vllm/v1/attention/selector.py"
    ):
        tree = s.tree(path)
        for top in ast.walk(tree):  # type: ignore[arg-type]
            if not isinstance(top, FuncDef):
                continue
            for node in own_nodes(top):
                if isinstance(node, ast.Call) and call_name(node) == "set_kv_cache_layout":
                    owner = next(
                        (
                            c.name
                            for c in ast.walk(tree)  # type: ignore[arg-type]
                            if isinstance(c, ast.ClassDef) and top in c.body
                        ),
                        None,
                    )
                    qual = f"{owner}.{top.name}" if owner else top.name
                    forced.append({"call": ast.unparse(node), "source": src(path, qual)})
    if forced:
        out["forced_by"] = forced
    return out


def attention_backends(s: Sources, layout: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    enum = (layout.get("enum") or {}).get("members", {})
    default_pref = layout.get("default_preference") or []
    for key, fname in BACKEND_FILES.items():
        path = BACKENDS_DIR + fname
        tree = s.tree(path)
        cls = backend_class(tree) if tree is not None else None
        if cls is None:
            out[key] = None
            continue
        name = [r["dims"] for r in returned_shapes(class_method(cls, "get_name"))]
        entry: dict[str, Any] = {
            "class": cls.name,
            "source": src(path, cls.name),
            "name": [n if isinstance(n, str) else n for n in name],
        }
        shape_fn = class_method(cls, "get_kv_cache_shape")
        if shape_fn is not None:
            entry["get_kv_cache_shape"] = {
                "params": params(shape_fn),
                "returns": returned_shapes(shape_fn, s),
                "source": src(path, f"{cls.name}.get_kv_cache_shape"),
            }
        else:
            entry["get_kv_cache_shape"] = None
        stride_fn = class_method(cls, "get_kv_cache_stride_order")
        if stride_fn is not None:
            entry["get_kv_cache_stride_order"] = {
                **(stride_orders(stride_fn) or {}),
                "source": src(path, f"{cls.name}.get_kv_cache_stride_order"),
            }
        else:
            entry["get_kv_cache_stride_order"] = None
        req = class_method(cls, "get_required_kv_cache_layout")
        if req is not None:
            entry["required_kv_cache_layout"] = {
                "returns": layout_returns(req),
                "source": src(path, f"{cls.name}.get_required_kv_cache_layout"),
            }
        sup = class_method(cls, "supported_kv_cache_layouts")
        if enum:
            entry["supported_kv_cache_layouts"] = {
                "returns": layout_returns(sup) if sup is not None else [{"value": None}],
                "source": src(path, f"{cls.name}.supported_kv_cache_layouts")
                if sup is not None
                else src(
                    "vllm/v1/attention/backend.py", "AttentionBackend.supported_kv_cache_layouts"
                ),
            }
        impl = impl_class_name(cls)
        entry["impl"] = impl
        entry["kv_read"] = kv_reads(tree, impl, path)  # type: ignore[arg-type]
        entry["registered_tensor"] = registered_tensor(entry, enum, default_pref)
        out[key] = entry
    return out


BHNC = ["num_blocks", "num_kv_heads", "block_size", "head_size + head_size_v"]


def registered_tensor(entry: dict[str, Any], enum: dict, default_pref: list) -> dict | None:
    """The per-layer tensor ``register_kv_caches`` gets, per layout: logical shape, the stride
    order (logical dims from outermost to innermost in memory) and the resulting physical shape."""
    out: dict[str, Any] = {}
    if enum:
        sup = (entry.get("supported_kv_cache_layouts") or {}).get("returns") or []
        firsts = []
        for r in sup:
            val = r.get("value")
            if isinstance(val, list) and val:
                firsts.append({"layout": val[0], "when": r.get("when")})
            elif val is None or "super()" in str(val):
                firsts.append({"layout": default_pref[0] if default_pref else None, "when": None})
        out["default_layout"] = firsts
        for layout in ("LBNHC", "LBHNC"):
            order = enum.get(layout, {}).get("layer_view_order_BHNC")
            if order is None:
                continue
            out[layout] = {
                "logical_shape": BHNC,
                "stride_order": order,
                "physical_shape": [BHNC[i] for i in order],
            }
        return out
    shape = entry.get("get_kv_cache_shape")
    if not shape:
        return None
    default = next((r for r in shape["returns"] if r["when"] is None), None)
    if default is None or not isinstance(default["dims"], list):
        return None
    dims = default["dims"]
    stride = entry.get("get_kv_cache_stride_order") or {}
    for layout in ("NHD", "HND"):
        order = stride.get(layout) if stride else list(range(len(dims)))
        if not isinstance(order, list) or len(order) != len(dims):
            out[layout] = {"logical_shape": dims, "stride_order": order}
            continue
        out[layout] = {
            "logical_shape": dims,
            "stride_order": order,
            "physical_shape": [dims[i] for i in order],
        }
    if not stride:
        out["note"] = "no get_kv_cache_stride_order: identity order, whatever the layout"
    return out


def enclosing_qualname(tree: ast.Module, target: ast.AST) -> str:
    for node in tree.body:
        if isinstance(node, FuncDef) and any(n is target for n in own_nodes(node)):
            return node.name
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, FuncDef) and any(n is target for n in own_nodes(fn)):
                    return f"{node.name}.{fn.name}"
    return "<module>"


def enclosing_tests(fn: ast.AST, target: ast.AST) -> list[str]:
    """The if-tests (``not (...)`` for else branches) on the path to ``target``."""

    def walk(body: list[ast.stmt], conds: list[str]) -> list[str] | None:
        for stmt in body:
            if stmt is target or any(n is target for n in ast.walk(stmt)):
                if isinstance(stmt, ast.If) and stmt is not target:
                    test = ast.unparse(stmt.test)
                    found = walk(stmt.body, [*conds, test])
                    if found is not None:
                        return found
                    found = walk(stmt.orelse, [*conds, f"not ({test})"])
                    if found is not None:
                        return found
                for attr in ("body", "orelse", "finalbody"):
                    sub = getattr(stmt, attr, None)
                    if isinstance(sub, list) and not isinstance(stmt, ast.If):
                        found = walk(sub, conds)
                        if found is not None:
                            return found
                return conds
        return None

    return walk(list(fn.body), []) or []  # type: ignore[attr-defined]


def function_by_qualname(tree: ast.Module, qual: str) -> ast.AST | None:
    return find_def(tree, qual)


def calls_in(s: Sources, paths: list[str], names: set[str]) -> list[dict[str, Any]]:
    """Calls to any of ``names`` in ``paths``, with their function and enclosing if-tests."""
    out = []
    for path in paths:
        tree = s.tree(path)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and call_name(node) in names:
                qual = enclosing_qualname(tree, node)
                fn = function_by_qualname(tree, qual)
                tests = enclosing_tests(fn, node) if fn is not None else []
                out.append(
                    {"call": ast.unparse(node), "source": src(path, qual), "when": tests or None}
                )
    return sorted(out, key=lambda d: (d["source"], d["call"]))


BUILDERS = {
    "initialize_kv_cache_tensors",
    "_allocate_kv_cache_tensors",
    "_reshape_kv_cache_tensors",
    "allocate_uniform_kv_caches",
    "allocate_kv_cache",
    "create_kv_cache_views",
    "map_kv_caches_to_kernel_blocks",
    "_update_hybrid_attention_mamba_layout",
    "bind_kv_cache",
}
MARKERS = (
    "get_kv_cache_shape",
    "get_kv_cache_stride_order",
    "permute",
    "kernel_block_size",
    "as_strided",
    "layer_view_order",
)


V2_RUNNER = WORKER_DIR + "gpu/model_runner.py"
V2_ATTN = WORKER_DIR + "gpu/attn_utils.py"


def builder_chain(s: Sources, path: str, qual: str) -> list[dict[str, Any]]:
    """The functions that build the dict handed to ``register_kv_caches``, from ``qual``
    down: the builder calls each makes and the markers of its body (what it uses)."""
    helpers = [path, WORKER_DIR + "utils.py", "vllm/v1/kv_cache_interface.py", V2_ATTN]
    mixin = WORKER_DIR + "kv_connector_model_runner_mixin.py"
    cls_name = qual.split(".")[0] if "." in qual else None
    chain: list[dict[str, Any]] = []
    todo = [(path, qual)]
    seen: set[str] = set()
    while todo:
        where, name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        fn = find_def(s.tree(where), name)
        if fn is None:
            continue
        text = ast.unparse(fn)
        called: list[str] = []
        nodes = sorted(
            (n for n in own_nodes(fn) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        )
        for node in nodes:
            if call_name(node) in BUILDERS and call_name(node) not in called:
                called.append(call_name(node))
        chain.append(
            {"source": src(where, name), "calls": called, "uses": [m for m in MARKERS if m in text]}
        )
        for callee in called:
            if callee == "bind_kv_cache":
                continue
            if cls_name and find_def(s.tree(path), f"{cls_name}.{callee}") is not None:
                todo.append((path, f"{cls_name}.{callee}"))
            elif find_def(s.tree(mixin), f"KVConnectorModelRunnerMixin.{callee}") is not None:
                todo.append((mixin, f"KVConnectorModelRunnerMixin.{callee}"))
            else:
                for cand in helpers:
                    if find_def(s.tree(cand), callee) is not None:
                        todo.append((cand, callee))
                        break
    return chain


def registered_caches(s: Sources) -> dict[str, Any]:
    runner = WORKER_DIR + "gpu_model_runner.py"
    worker_files = [p for p in s.glob(WORKER_DIR) if p.count("/") <= 4]
    out: dict[str, Any] = {
        "register_kv_caches": calls_in(s, worker_files, {"register_kv_caches"}),
        "register_cross_layers_kv_cache": calls_in(
            s, worker_files, {"register_cross_layers_kv_cache"}
        ),
        "builders": builder_chain(s, runner, "GPUModelRunner.initialize_kv_cache"),
    }
    if find_def(s.tree(V2_ATTN), "init_kv_cache") is not None:
        out["builders_v2_runner"] = builder_chain(s, V2_ATTN, "init_kv_cache")
    kvc = find_def(s.tree(runner), "GPUModelRunner.initialize_kv_cache")
    if kvc is not None:
        out["initialize_kv_cache_params"] = params(kvc)
    return out


def env_default(s: Sources, name: str) -> str | None:
    """The default expression of ``vllm.envs.<name>`` (the lambda of ``environment_variables``)."""
    tree = s.tree("vllm/envs.py")
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == name:
                    body = value.body if isinstance(value, ast.Lambda) else value
                    return ast.unparse(body)
    return None


def runner_selection(s: Sources) -> dict[str, Any]:
    """Which GPU model runner the worker uses: V1 (``gpu_model_runner.py``) or V2
    (``gpu/model_runner.py``), and what makes V2 the default."""
    config = "vllm/config/vllm.py"
    tree = s.tree(config)
    out: dict[str, Any] = {
        "env_VLLM_USE_V2_MODEL_RUNNER": env_default(s, "VLLM_USE_V2_MODEL_RUNNER"),
        "v1_runner": src(WORKER_DIR + "gpu_model_runner.py", "GPUModelRunner"),
    }
    v2 = find_def(s.tree(V2_RUNNER), "GPUModelRunner")
    out["v2_runner"] = src(V2_RUNNER, "GPUModelRunner") if v2 is not None else None
    load = find_def(s.tree(V2_RUNNER), "GPUModelRunner.load_model")
    out["v2_runner_load_model"] = (
        {"params": params(load), "source": src(V2_RUNNER, "GPUModelRunner.load_model")}
        if load is not None
        else None
    )
    for label, qual in (
        ("use_v2_model_runner", "VllmConfig.use_v2_model_runner"),
        ("is_default_v2_model_runner_model", "VllmConfig._is_default_v2_model_runner_model"),
    ):
        fn = find_def(tree, qual)
        out[label] = (
            {
                "returns": [{"value": r["dims"], "when": r["when"]} for r in returned_shapes(fn)],
                "source": src(config, qual),
            }
            if fn is not None
            else None
        )
    archs = None
    for node in tree.body if tree is not None else []:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == (
            "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"
        ):
            archs = sorted(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    out["default_v2_architectures"] = archs
    fn = find_def(tree, "VllmConfig._get_v2_model_runner_unsupported_features")
    if fn is not None:
        feats = []
        for node in own_nodes(fn):
            if isinstance(node, ast.Call) and call_name(node) in ("append", "extend") and node.args:
                arg = node.args[0]
                feats.append(arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg))
        out["v2_unsupported_features"] = {
            "values": sorted(feats),
            "source": src(config, "VllmConfig._get_v2_model_runner_unsupported_features"),
        }
    return out


# -- connector API


CONNECTOR_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"


def method_table(cls: ast.ClassDef) -> dict[str, Any]:
    out = {}
    for node in cls.body:
        if isinstance(node, FuncDef):
            decos = [d for d in decorators(node) if d != "override"]
            entry: dict[str, Any] = {"params": params(node)}
            if decos:
                entry["decorators"] = decos
            out[node.name] = entry
    return out


def connector_api(s: Sources) -> dict[str, Any]:
    tree = s.tree(CONNECTOR_BASE)
    cls = find_class(tree, "KVConnectorBase_V1")
    if cls is None:
        return {"source": CONNECTOR_BASE, "missing": True}
    methods = method_table(cls)
    role = find_class(tree, "KVConnectorRole")
    roles = (
        [ast.unparse(n.targets[0]) for n in role.body if isinstance(n, ast.Assign)] if role else []
    )
    other_abstract = {}
    for node in tree.body:  # type: ignore[union-attr]
        if isinstance(node, ast.ClassDef) and node.name != "KVConnectorBase_V1":
            abstract = [
                f.name
                for f in node.body
                if isinstance(f, FuncDef) and "abstractmethod" in decorators(f)
            ]
            if abstract:
                other_abstract[node.name] = {
                    m: params(class_method(node, m))
                    for m in abstract  # type: ignore[arg-type]
                }
    class_attrs = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            value = ast.unparse(node.value) if node.value is not None else None
            class_attrs[ast.unparse(node.target)] = f"{ast.unparse(node.annotation)} = {value}"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                class_attrs[ast.unparse(target)] = ast.unparse(node.value)
    return {
        "source": src(CONNECTOR_BASE, "KVConnectorBase_V1"),
        "bases": [ast.unparse(b) for b in cls.bases],
        "class_attributes": class_attrs,
        "methods": methods,
        "abstract": sorted(
            m for m, e in methods.items() if "abstractmethod" in e.get("decorators", [])
        ),
        "roles": roles,
        "roles_source": src(CONNECTOR_BASE, "KVConnectorRole"),
        "other_abstract_classes": other_abstract,
        "factory": connector_factory(s),
    }


def connector_factory(s: Sources) -> dict[str, Any]:
    tree = s.tree(FACTORY)
    cls = find_class(tree, "KVConnectorFactory")
    if cls is None:
        return {"source": FACTORY, "missing": True}
    out: dict[str, Any] = {"source": src(FACTORY, "KVConnectorFactory")}
    loaders = []
    for fn in cls.body:
        if not isinstance(fn, FuncDef):
            continue
        text = ast.unparse(fn)
        if "kv_connector_module_path" in text:
            loaders.append(src(FACTORY, f"KVConnectorFactory.{fn.name}"))
            for node in own_nodes(fn):
                if isinstance(node, ast.If) and "supports_kw" in ast.unparse(node.test):
                    body = ast.unparse(node)
                    out["kv_cache_config_check"] = {
                        "test": ast.unparse(node.test),
                        "action": "raise" if "raise " in body else "warn (2-argument constructor)",
                        "source": src(FACTORY, f"KVConnectorFactory.{fn.name}"),
                    }
        if fn.name.startswith("create_connector"):
            out["create_connector"] = src(FACTORY, f"KVConnectorFactory.{fn.name}")
            out["create_connector_params"] = params(fn)
            out["instantiation"] = sorted(
                {
                    ast.unparse(n)
                    for n in own_nodes(fn)
                    if isinstance(n, ast.Call) and ast.unparse(n.func) == "connector_cls"
                }
            )
            hma = [
                ast.unparse(n.test)
                for n in own_nodes(fn)
                if isinstance(n, ast.If) and "hma" in ast.unparse(n.test)
            ]
            if hma:
                out["hma_check"] = {"test": hma[0], "action": "raise"}
    out["module_path_loaders"] = loaders
    return out


# -- hooks the package uses

MODELS = "vllm/model_executor/models/"
SCHED_OUTPUT = "vllm/v1/core/sched/output.py"
ROTARY_PATHS = [
    "vllm/model_executor/layers/rotary_embedding.py",
    "vllm/model_executor/layers/rotary_embedding/base.py",
]

#: Where the hooks live: key -> candidate files (the first that defines the class wins).
HOOK_FILES: dict[str, list[str]] = {
    "llama": [MODELS + "llama.py"],
    "qwen2": [MODELS + "qwen2.py"],
    "qwen3": [MODELS + "qwen3.py"],
    "sched": [SCHED_OUTPUT],
    "request": ["vllm/v1/request.py"],
    "gpu_runner": [WORKER_DIR + "gpu_model_runner.py"],
    "cpu_runner": [WORKER_DIR + "cpu_model_runner.py"],
    "rotary": ROTARY_PATHS,
    "ops": ["vllm/_custom_ops.py"],
    "plugins": ["vllm/plugins/__init__.py"],
    "parallel": ["vllm/distributed/parallel_state.py"],
    "forward": ["vllm/forward_context.py"],
    "kv_config": ["vllm/config/kv_transfer.py", "vllm/config.py"],
}
#: (qualname, file key, kind); kind: function | attribute | class. ``_custom_ops.`` names a
#: module-level function of ``vllm/_custom_ops.py``.
HOOKS: list[tuple[str, str, str]] = [
    ("LlamaModel.get_input_embeddings", "llama", "function"),
    ("LlamaModel.embed_input_ids", "llama", "function"),
    ("Qwen2Model.get_input_embeddings", "qwen2", "function"),
    ("Qwen2Model.embed_input_ids", "qwen2", "function"),
    ("LlamaForCausalLM.compute_logits", "llama", "function"),
    ("Qwen3Attention.q_norm", "qwen3", "attribute"),
    ("Qwen3Attention.k_norm", "qwen3", "attribute"),
    ("CachedRequestData.resumed_from_preemption", "sched", "attribute"),
    ("CachedRequestData.resumed_req_ids", "sched", "attribute"),
    ("CachedRequestData.req_ids", "sched", "attribute"),
    ("CachedRequestData.new_block_ids", "sched", "attribute"),
    ("CachedRequestData.num_computed_tokens", "sched", "attribute"),
    ("NewRequestData.req_id", "sched", "attribute"),
    ("NewRequestData.prompt_token_ids", "sched", "attribute"),
    ("NewRequestData.block_ids", "sched", "attribute"),
    ("NewRequestData.num_computed_tokens", "sched", "attribute"),
    ("SchedulerOutput.scheduled_new_reqs", "sched", "attribute"),
    ("SchedulerOutput.scheduled_cached_reqs", "sched", "attribute"),
    ("SchedulerOutput.num_scheduled_tokens", "sched", "attribute"),
    ("Request.prompt_token_ids", "request", "attribute"),
    ("Request.request_id", "request", "attribute"),
    ("Request.kv_transfer_params", "request", "attribute"),
    ("GPUModelRunner.load_model", "gpu_runner", "function"),
    ("GPUModelRunner.get_model", "gpu_runner", "function"),
    ("CPUModelRunner.load_model", "cpu_runner", "function"),
    ("RotaryEmbedding", "rotary", "class"),
    ("RotaryEmbedding._compute_cos_sin_cache", "rotary", "function"),
    ("RotaryEmbedding.is_neox_style", "rotary", "attribute"),
    ("_custom_ops.cpu_attn_reshape_and_cache", "ops", "function"),
    ("load_general_plugins", "plugins", "function"),
    ("get_tensor_model_parallel_rank", "parallel", "function"),
    ("get_tensor_model_parallel_world_size", "parallel", "function"),
    ("get_tp_group", "parallel", "function"),
    ("set_forward_context", "forward", "function"),
    ("KVTransferConfig", "kv_config", "class"),
]
ATTN_ATTRS = (
    "qkv_proj",
    "o_proj",
    "rotary_emb",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "scaling",
)
PLATFORM_METHODS = (
    "is_cpu",
    "is_cuda",
    "is_rocm",
    "is_xpu",
    "is_tpu",
    "is_cuda_alike",
    "is_out_of_tree",
)


def hook(s: Sources, paths: list[str], qual: str, kind: str) -> dict[str, Any] | None:
    for path in paths:
        tree = s.tree(path)
        if tree is None:
            continue
        if kind == "attribute":
            cls_name, attr = qual.split(".")
            if find_class(tree, cls_name) is None:
                continue
            owner = class_attribute(tree, cls_name, attr)
            if owner is None:
                return None
            return {"source": src(path, f"{owner}.{attr}")}
        node = find_def(tree, qual)
        if node is None and "." in qual:
            cls_name, meth = qual.split(".")
            owner = class_attribute(tree, cls_name, meth)  # a method of a base in this file
            if owner is not None and owner != cls_name:
                node, qual = find_def(tree, f"{owner}.{meth}"), f"{owner}.{meth}"
        if node is None:
            if "." in qual:
                cls = find_class(tree, qual.split(".")[0])
                if cls is not None:
                    return {
                        "source": None,
                        "inherited_from": [ast.unparse(b) for b in cls.bases],
                        "class_source": src(path, cls.name),
                    }
            continue
        if kind == "class":
            return {"source": src(path, qual)}
        return {"source": src(path, qual), "params": params(node)}
    return None


def hooks(s: Sources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, files, kind in HOOKS:
        out[label] = hook(s, HOOK_FILES[files], label.removeprefix("_custom_ops."), kind)
    for model_file, cls_name in (
        ("llama.py", "LlamaAttention"),
        ("qwen2.py", "Qwen2Attention"),
        ("qwen3.py", "Qwen3Attention"),
    ):
        path = MODELS + model_file
        tree = s.tree(path)
        missing = [a for a in ATTN_ATTRS if class_attribute(tree, cls_name, a) is None]
        out[f"{cls_name}.attributes"] = {"source": src(path, cls_name), "missing": missing}
    envs = s.text("vllm/envs.py") or ""
    out["envs.VLLM_CPU_ATTN_SPLIT_KV"] = (
        {"source": "vllm/envs.py::environment_variables"}
        if '"VLLM_CPU_ATTN_SPLIT_KV"' in envs
        else None
    )
    out["envs.VLLM_KV_CACHE_LAYOUT"] = (
        {"source": "vllm/envs.py::environment_variables"}
        if '"VLLM_KV_CACHE_LAYOUT"' in envs
        else None
    )
    return out


def kv_transfer_timing(s: Sources) -> dict[str, Any]:
    """Where the GPU worker creates the connector (ensure_kv_transfer_initialized), relative to
    load_model, and the order in which the executor calls the worker."""
    path = WORKER_DIR + "gpu_worker.py"
    tree = s.tree(path)
    calls = calls_in(s, [path], {"ensure_kv_transfer_initialized"})
    # module-level helpers calling it, then the Worker methods calling those helpers
    helpers = {c["source"].split("::")[1] for c in calls if "." not in c["source"].split("::")[1]}
    callers = sorted(
        {c["source"].split("::")[1] for c in calls if "." in c["source"].split("::")[1]}
    )
    if helpers:
        via = calls_in(s, [path], helpers)
        callers += sorted({c["source"].split("::")[1] for c in via if "Worker." in c["source"]})
    rpc_order: list[str] = []
    for exe in ("vllm/v1/executor/uniproc_executor.py", "vllm/executor/uniproc_executor.py"):
        fn = find_def(s.tree(exe), "UniProcExecutor._init_executor")
        if fn is None:
            continue
        for node in sorted(
            (n for n in own_nodes(fn) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        ):
            name = call_name(node)
            if name == "collective_rpc" and node.args and isinstance(node.args[0], ast.Constant):
                rpc_order.append(node.args[0].value)
            elif name in ("init_worker", "init_device", "load_model") and "driver_worker" in (
                ast.unparse(node.func)
            ):
                rpc_order.append(name)
        executor_source = src(exe, "UniProcExecutor._init_executor")
        break
    else:
        executor_source = None
    after = None
    methods = [c.split(".")[-1] for c in callers]
    if "initialize_from_config" in methods:
        after = True  # the engine core calls it after load_model, once the KV cache is sized
    elif "init_device" in methods:
        after = False
    return {
        "ensure_kv_transfer_initialized": calls,
        "called_from_worker_methods": callers,
        "kv_transfer_after_model_load": after,
        "executor_rpc_order": rpc_order,
        "executor_source": executor_source,
        "initialize_from_config_source": "vllm/v1/engine/core.py::EngineCore._initialize_kv_caches",
        "worker_load_model_params": params(find_def(tree, "Worker.load_model"))
        if find_def(tree, "Worker.load_model")
        else None,
    }


def platform_api(s: Sources) -> dict[str, Any]:
    path = "vllm/platforms/interface.py"
    tree = s.tree(path)
    out: dict[str, Any] = {}
    for name in PLATFORM_METHODS:
        fn = find_def(tree, f"Platform.{name}")
        out[name] = {"source": src(path, f"Platform.{name}"), "params": params(fn)} if fn else None
    for attr in ("device_type", "device_name", "dispatch_key"):
        owner = class_attribute(tree, "Platform", attr)
        out[attr] = {"source": src(path, f"{owner}.{attr}")} if owner else None
    enum = find_class(tree, "PlatformEnum")
    out["PlatformEnum"] = (
        [ast.unparse(n.targets[0]) for n in enum.body if isinstance(n, ast.Assign)]
        if enum
        else None
    )
    init = s.text("vllm/platforms/__init__.py") or ""
    out["current_platform"] = (
        {"source": "vllm/platforms/__init__.py::__getattr__", "lazy": True}
        if "def __getattr__" in init and "current_platform" in init
        else {"source": "vllm/platforms/__init__.py::current_platform"}
    )
    return out


def annotations(package: str, version: str) -> list[dict[str, str]]:
    return [
        {"key": a["key"], "fact": a["fact"], "source": a["source"], "manual": True}
        for a in ANNOTATIONS
        if a["package"] == package and in_range(version, *a["range"])
    ]


def record_vllm(s: Sources, version: str) -> dict[str, Any]:
    layout = layout_selection(s)
    return {
        "schema": SCHEMA,
        "package": "vllm",
        "version": version,
        "artifact": s.artifact(),
        "kv_cache_layout": layout,
        "attention_backends": attention_backends(s, layout),
        "registered_kv_caches": registered_caches(s),
        "model_runner_selection": runner_selection(s),
        "connector_api": connector_api(s),
        "kv_transfer_init": kv_transfer_timing(s),
        "hooks": hooks(s),
        "platform": platform_api(s),
        "annotations": annotations("vllm", version),
    }


# --------------------------------------------------------------------------------------------
# vllm-ascend extractors

ASC = "vllm_ascend/"


def ascend_pins(s: Sources) -> dict[str, Any]:
    targets: dict[str, set[str]] = {}
    for path in s.glob(ASC):
        tree = s.tree(path)
        for node in ast.walk(tree):  # type: ignore[arg-type]
            if (
                isinstance(node, ast.Call)
                and call_name(node) == "vllm_version_is"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                targets.setdefault(node.args[0].value, set()).add(path)
    patch_dirs = sorted(
        {
            m.group(1)
            for n in s.names
            if (m := re.match(r"vllm_ascend/patch/\w+/(patch_\d+_\d+_\d+)/", n))
        }
    )
    out: dict[str, Any] = {
        "vllm_version_is": {k: len(v) for k, v in sorted(targets.items())},
        "vllm_version_is_source": "vllm_ascend/utils.py::vllm_version_is (files calling it)",
        "versioned_patch_dirs": patch_dirs,
    }
    docker = s.text("Dockerfile")
    if docker:
        m = re.search(r"ARG VLLM_TAG=(\S+)", docker)
        out["dockerfile_vllm_tag"] = m.group(1) if m else None
    meta = next((n for n in s.names if n.endswith("METADATA") or n == "PKG-INFO"), None)
    if meta:
        reqs = [
            line.split(":", 1)[1].strip()
            for line in (s.text(meta) or "").splitlines()
            if line.startswith("Requires-Dist:")
            and re.match(r"Requires-Dist:\s*(vllm|torch)", line)
        ]
        out["requires_dist_vllm_torch"] = reqs
    candidates = sorted(targets, key=vkey) if targets else []
    pinned = candidates[-1] if candidates else None
    if not pinned and patch_dirs:
        pinned = patch_dirs[-1].removeprefix("patch_").replace("_", ".")
    out["pinned_vllm"] = out.get("dockerfile_vllm_tag", "").lstrip("v") if docker else pinned
    return out


def ascend_backend(s: Sources) -> dict[str, Any]:
    out = {}
    for path in (ASC + "attention/attention_v1.py", ASC + "attention/attention.py"):
        tree = s.tree(path)
        cls = find_class(tree, "AscendAttentionBackend")
        if cls is None:
            continue
        shape = class_method(cls, "get_kv_cache_shape")
        out = {
            "class": cls.name,
            "source": src(path, cls.name),
            "name": [r["dims"] for r in returned_shapes(class_method(cls, "get_name"))],
            "get_kv_cache_shape": {
                "params": params(shape) if shape else None,
                "returns": returned_shapes(shape),
                "source": src(path, f"{cls.name}.get_kv_cache_shape"),
            },
        }
        for extra in (
            "get_bsh_kv_cache_shape",
            "get_supported_block_size",
            "get_supported_kernel_block_sizes",
        ):
            fn = class_method(cls, extra)
            if fn is not None:
                out[extra] = {
                    "returns": returned_shapes(fn),
                    "source": src(path, f"{cls.name}.{extra}"),
                }
        break
    return out


def ascend_runner(s: Sources) -> dict[str, Any]:
    path = ASC + "worker/model_runner_v1.py"
    tree = s.tree(path)
    cls = find_class(tree, "NPUModelRunner")
    out: dict[str, Any] = {
        "class": src(path, "NPUModelRunner") if cls else None,
        "bases": [ast.unparse(b) for b in cls.bases] if cls else None,
    }
    if cls is None:
        return out
    out["register_kv_caches"] = calls_in(s, [path], {"register_kv_caches"})
    stores: dict[str, str] = {}
    kv_views: dict[str, str] = {}
    for fn in cls.body:
        if not isinstance(fn, FuncDef):
            continue
        for node in own_nodes(fn):
            if not isinstance(node, ast.Assign):
                continue
            text = ast.unparse(node)
            targets = [ast.unparse(t) for t in node.targets]
            if any(t.startswith("kv_caches[") for t in targets):
                stores.setdefault(text, src(path, f"NPUModelRunner.{fn.name}"))
            if targets and targets[0] in ("k_cache", "v_cache", "kv_cache") and "view" in text:
                kv_views.setdefault(text, src(path, f"NPUModelRunner.{fn.name}"))
    out["kv_caches_stores"] = [{"code": c, "source": w} for c, w in sorted(stores.items())]
    out["k_v_views"] = [{"code": c, "source": w} for c, w in sorted(kv_views.items())]
    v2 = ASC + "worker/v2/attn_utils.py"
    if s.tree(v2) is not None:
        out["v2_runner_kv_caches_stores"] = sorted(
            {
                ast.unparse(n)
                for n in ast.walk(s.tree(v2))  # type: ignore[arg-type]
                if isinstance(n, ast.Assign)
                and any(ast.unparse(t).startswith("kv_caches[") for t in n.targets)
            }
        )
        out["v2_runner_source"] = v2
    for name in ("initialize_kv_cache", "load_model", "get_model"):
        fn = class_method(cls, name)
        out[name] = (
            {"source": src(path, f"NPUModelRunner.{name}"), "params": params(fn)} if fn else None
        )
    out["v2_runner"] = ascend_v2_runner(s)
    return out


def ascend_v2_runner(s: Sources) -> dict[str, Any] | None:
    """The V2 ``NPUModelRunner`` (``worker/v2/model_runner.py``): its bases and whether it
    defines ``load_model`` itself (null: inherited, from vLLM's V2 ``GPUModelRunner``)."""
    path = ASC + "worker/v2/model_runner.py"
    cls = find_class(s.tree(path), "NPUModelRunner")
    if cls is None:
        return None
    fn = class_method(cls, "load_model")
    return {
        "class": src(path, "NPUModelRunner"),
        "bases": [ast.unparse(b) for b in cls.bases],
        "load_model": (
            {"source": src(path, "NPUModelRunner.load_model"), "params": params(fn)} if fn else None
        ),
    }


def ascend_worker(s: Sources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in (ASC + "worker/worker_v1.py", ASC + "worker/worker.py"):
        tree = s.tree(path)
        cls = find_class(tree, "NPUWorker")
        if cls is None:
            continue
        calls = calls_in(s, [path], {"ensure_kv_transfer_initialized"})
        methods = sorted({c["source"].split("::")[1] for c in calls})
        out = {
            "class": src(path, "NPUWorker"),
            "bases": [ast.unparse(b) for b in cls.bases],
            "ensure_kv_transfer_initialized": calls,
            "kv_transfer_after_model_load": True
            if any(m.endswith(".initialize_from_config") for m in methods)
            else False
            if any(m.endswith("._init_worker_distributed_environment") for m in methods)
            else None,
        }
        # which runner the worker builds: every assignment to self.use_v2_model_runner
        choice = [
            (n.lineno, ast.unparse(n), src(path, f"NPUWorker.{fn.name}"))
            for fn in cls.body
            if isinstance(fn, FuncDef)
            for n in own_nodes(fn)
            if isinstance(n, ast.Assign)
            and any(ast.unparse(t) == "self.use_v2_model_runner" for t in n.targets)
        ]
        out["use_v2_model_runner"] = [{"code": c, "source": w} for _, c, w in sorted(choice)]
        for name in (
            "load_model",
            "initialize_from_config",
            "_init_worker_distributed_environment",
        ):
            fn = class_method(cls, name)
            out[name] = (
                {"source": src(path, f"NPUWorker.{name}"), "params": params(fn)} if fn else None
            )
        break
    return out


def record_ascend(s: Sources, version: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "package": "vllm-ascend",
        "version": version,
        "artifact": s.artifact(),
        "pins": ascend_pins(s),
        "attention_backend": ascend_backend(s),
        "model_runner": ascend_runner(s),
        "worker": ascend_worker(s),
        "annotations": annotations("vllm-ascend", version),
    }


# --------------------------------------------------------------------------------------------


def fixture_name(package: str, version: str) -> str:
    return f"{dist_name(package)}-{version}.json"


def dumps(data: Any, indent: int = 0, used: int = 0, width: int = 100) -> str:
    """JSON with sorted keys and 2-space indentation; a list or object that fits on its line
    (``used`` columns are taken already) within ``width`` columns is written on one line."""
    one = json.dumps(data, sort_keys=True, separators=(", ", ": "))
    if not isinstance(data, (dict, list)) or not data or used + len(one) <= width:
        return one
    pad = " " * (indent + 2)
    if isinstance(data, list):
        items = [pad + dumps(v, indent + 2, indent + 2, width) for v in data]
    else:
        items = []
        for key in sorted(data):
            head = pad + json.dumps(key) + ": "
            items.append(head + dumps(data[key], indent + 2, len(head), width))
    close = "]" if isinstance(data, list) else "}"
    return (
        ("[" if isinstance(data, list) else "{")
        + "\n"
        + ",\n".join(items)
        + "\n"
        + " " * indent
        + close
    )


def write_json(path: Path, data: Any) -> None:
    text = dumps(data) + "\n"
    assert json.loads(text) == json.loads(json.dumps(data))
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests/fixtures/engine_contracts")
    ap.add_argument(
        "--cache",
        type=Path,
        default=REPO / ".cache/engine-src",
        help="slim source zips, one per release (git-ignored)",
    )
    ap.add_argument(
        "--tmp",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where a wheel is downloaded before it is sliced and deleted",
    )
    ap.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help="read wheels/sdists from here instead of downloading",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        help="PACKAGE==VERSION (repeatable); default: every release",
    )
    args = ap.parse_args(argv)

    wanted = [(p, v) for p, versions in RELEASES.items() for v in versions]
    if args.only:
        wanted = [tuple(o.split("==", 1)) for o in args.only]  # type: ignore[misc]
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for package, version in wanted:
        try:
            slim = fetch(package, version, args.cache, args.wheel_dir, args.tmp)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other releases
            print(f"{package}=={version}: {exc}", file=sys.stderr)
            failed.append(f"{package}=={version}")
            continue
        s = Sources(slim)
        data = record_vllm(s, version) if package == "vllm" else record_ascend(s, version)
        write_json(args.out / fixture_name(package, version), data)
        print(f"{package}=={version}: {fixture_name(package, version)}")

    entries = []
    for path in sorted(args.out.glob("*.json")):
        if path.name == "index.json":
            continue
        data = json.loads(path.read_text())
        entries.append(
            {
                "package": data["package"],
                "version": data["version"],
                "file": path.name,
                "artifact": data["artifact"]["artifact"],
            }
        )
    entries.sort(key=lambda e: (e["package"], vkey(e["version"])))
    write_json(args.out / "index.json", {"schema": SCHEMA, "fixtures": entries})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
