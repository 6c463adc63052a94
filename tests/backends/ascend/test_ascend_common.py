"""Shared pieces of the Ascend tests, and the Ascend checks that need no device.

``check_*`` build one case on the CPU, run the torch reference there, run the given op set on
``device`` and compare with the per-dtype tolerances of ``conftest.TOLERANCES``. The contract tests
(``test_ascend_contract.py``, emulated operators on CPU) and the on-device tests
(``test_ascend_npu.py``) call the same checks.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from numerics import assert_close, nan_like
from repo_paths import REPO_ROOT

from lmcache_backend.ops import reference

ROOT = REPO_ROOT
ASCEND_MODULE = "lmcache_backend.backends.ascend"


# ------------------------------------------------------------------------------- importing


def import_ascend_backend() -> ModuleType:
    """Import the Ascend backend (``make test`` installs the package, editable)."""
    return importlib.import_module(ASCEND_MODULE)


# ---------------------------------------------------------------------------- case builders


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def vllm_cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """vLLM's ``[max_pos, R]`` fp32 table: ``R/2`` cosines then ``R/2`` sines."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def query_positions(num_keys: int, num_queries: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted distinct positions in ``[0, num_keys)``, always holding the last one."""
    num_queries = min(num_queries, num_keys)
    if num_queries == 0:
        return torch.zeros(0, dtype=torch.int64)
    rest = torch.randperm(num_keys - 1, generator=gen)[: num_queries - 1]
    return torch.sort(torch.cat((rest, torch.tensor([num_keys - 1])))).values


# ------------------------------------------------------------------------------------ checks


def check_rope(
    ops: Any,
    device: torch.device | str,
    num_tokens: int,
    dtype: torch.dtype,
    is_neox: bool,
    *,
    heads: int = 4,
    head_dim: int = 64,
    rot_dim: int | None = None,
    two_d: bool = False,
    seed: int = 0,
) -> None:
    """``rope_rerotate_k`` in place, against the reference (and against RoPE at new positions)."""
    gen = _gen(seed)
    rot_dim = rot_dim or head_dim
    max_pos = 4096
    cache = vllm_cos_sin_cache(max_pos, rot_dim)
    old = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    new = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    raw = _randn(num_tokens, heads, head_dim, dtype=torch.float32, gen=gen)
    k = reference.apply_rope(raw, old, cache, is_neox).to(dtype)

    expected = k.clone()
    reference.rope_rerotate_k(expected, old, new, cache, is_neox)

    k_dev = k.to(device)
    arg = k_dev.view(num_tokens, heads * head_dim) if two_d else k_dev
    out = ops.rope_rerotate_k(arg, old.to(device), new.to(device), cache.to(device), is_neox)
    assert out is arg, "rope_rerotate_k must return its (in-place) input"
    assert_close(k_dev.cpu(), expected, dtype)
    if num_tokens and rot_dim < head_dim:
        assert torch.equal(k_dev.cpu()[..., rot_dim:], k[..., rot_dim:]), "pass-through changed"
    if dtype == torch.float32:
        # Re-rotation equals rotating the raw keys at the new positions directly.
        assert_close(k_dev.cpu(), reference.apply_rope(raw, new, cache, is_neox), dtype)


def check_deviation(
    ops: Any,
    device: torch.device | str,
    num_tokens: int,
    dtype: torch.dtype,
    ratio: float,
    *,
    invalid_fraction: float = 0.2,
    num_reusable: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """``kv_deviation_topk`` returns exactly the reference's indices (int64, on ``device``)."""
    gen = _gen(seed)
    k_fresh = _randn(num_tokens, 2, 16, dtype=dtype, gen=gen)
    k_cached = _randn(num_tokens, 2, 16, dtype=dtype, gen=gen)
    valid = torch.rand(num_tokens, generator=gen) >= invalid_fraction
    expected = reference.kv_deviation_topk(k_fresh, k_cached, valid, ratio, num_reusable)
    # valid_mask stays on the CPU, as LMCache's retriever hands it over.
    got = ops.kv_deviation_topk(k_fresh.to(device), k_cached.to(device), valid, ratio, num_reusable)
    assert got.dtype == torch.int64
    assert got.device.type == torch.device(device).type
    assert torch.equal(got.cpu(), expected), f"{got.cpu().tolist()} != {expected.tolist()}"
    return got


def check_gather(
    ops: Any, device: torch.device | str, num_tokens: int, dtype: torch.dtype, count: int, seed=0
) -> None:
    """``gather_rows`` matches the reference; the result is a new tensor."""
    gen = _gen(seed)
    x = _randn(num_tokens, 3, 8, dtype=dtype, gen=gen)
    idx = torch.randint(0, max(num_tokens, 1), (count,), generator=gen)
    x_dev = x.to(device)
    got = ops.gather_rows(x_dev, idx.to(device))
    assert got.shape == (count, 3, 8) and got.dtype == dtype
    assert torch.equal(got.cpu(), reference.gather_rows(x, idx))
    if count:
        assert got.data_ptr() != x_dev.data_ptr()


def check_scatter(
    ops: Any,
    device: torch.device | str,
    num_tokens: int,
    dtype: torch.dtype,
    count: int,
    *,
    nan_prefill: bool,
    seed: int = 0,
) -> None:
    """``scatter_rows`` writes in place exactly the rows the reference writes."""
    gen = _gen(seed)
    dst = _randn(num_tokens, 3, 8, dtype=dtype, gen=gen)
    if nan_prefill:
        dst = nan_like(dst)
    idx = torch.randperm(num_tokens, generator=gen)[:count]
    src = _randn(count, 3, 8, dtype=torch.float32, gen=gen)  # cast to dst.dtype by the op
    expected = reference.scatter_rows(dst.clone(), idx, src)

    dst_dev = dst.to(device)
    out = ops.scatter_rows(dst_dev, idx.to(device), src.to(device))
    assert out is dst_dev, "scatter_rows must return its (in-place) destination"
    torch.testing.assert_close(dst_dev.cpu(), expected, rtol=0, atol=0, equal_nan=True)
    if nan_prefill and count == num_tokens:
        assert not dst_dev.isnan().any(), "a scattered row was not written"


def check_attention(
    ops: Any,
    device: torch.device | str,
    num_keys: int,
    num_queries: int,
    dtype: torch.dtype,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int = 64,
    seed: int = 0,
) -> None:
    """``attention_at_positions`` matches the reference's exact per-position causal mask."""
    gen = _gen(seed)
    positions = query_positions(num_keys, num_queries, gen)
    q = _randn(positions.shape[0], heads, head_dim, dtype=dtype, gen=gen)
    k = _randn(num_keys, kv_heads, head_dim, dtype=dtype, gen=gen)
    v = _randn(num_keys, kv_heads, head_dim, dtype=dtype, gen=gen)
    scale = head_dim**-0.5
    expected = reference.attention_at_positions(q, k, v, positions, scale)
    got = ops.attention_at_positions(q.to(device), k.to(device), v.to(device), positions, scale)
    assert got.shape == expected.shape and got.dtype == dtype
    assert got.device.type == torch.device(device).type
    assert_close(got.cpu(), expected, dtype)


def check_paged(
    ops: Any,
    device: torch.device | str,
    num_tokens: int,
    dtype: torch.dtype,
    *,
    block_size: int = 16,
    kv_heads: int = 2,
    head_dim: int = 32,
    padding: int = 0,
    seed: int = 0,
) -> None:
    """``paged_kv_write`` into NaN-prefilled caches, then ``paged_kv_read`` back, both equal to
    the reference; ``padding`` tokens carry slot -1 and must not be written."""
    gen = _gen(seed)
    num_blocks = (num_tokens + padding) // block_size + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    total = num_tokens + padding
    key = _randn(total, kv_heads, head_dim, dtype=dtype, gen=gen)
    value = _randn(total, kv_heads, head_dim, dtype=dtype, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:total]
    slots[torch.randperm(total, generator=gen)[:padding]] = -1

    exp_k, exp_v = key_cache.clone(), value_cache.clone()
    reference.paged_kv_write(key, value, exp_k, exp_v, slots)

    kc, vc = key_cache.to(device), value_cache.to(device)
    ops.paged_kv_write(key.to(device), value.to(device), kc, vc, slots.to(device))
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(kc.cpu(), exp_k, **exact)
    torch.testing.assert_close(vc.cpu(), exp_v, **exact)

    written = slots[slots >= 0]
    got_k, got_v = ops.paged_kv_read(kc, vc, written.to(device))
    ref_k, ref_v = reference.paged_kv_read(exp_k, exp_v, written)
    assert torch.equal(got_k.cpu(), ref_k) and torch.equal(got_v.cpu(), ref_v)
    assert torch.equal(got_k.cpu(), key[slots >= 0]), "read-back differs from the written keys"


# ------------------------------------------------------------- checks that need no NPU at all


def test_get_ops_ascend_names_what_is_missing() -> None:
    from lmcache_backend.device import npu_unavailable_reason
    from lmcache_backend.ops import BackendUnavailable, get_ops

    reason = npu_unavailable_reason()
    if reason is None:
        pytest.skip("an NPU is usable here; get_ops('ascend') loads")
    import_ascend_backend()
    with pytest.raises(BackendUnavailable) as info:
        get_ops("ascend")
    assert str(info.value) == reason
    assert "torch_npu" in str(info.value) or "NPU" in str(info.value)


def test_load_raises_with_the_device_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_backend import device
    from lmcache_backend.ops import BackendUnavailable

    backend = import_ascend_backend()
    monkeypatch.setattr(device, "npu_unavailable_reason", lambda: "no NPU visible (test)")
    with pytest.raises(BackendUnavailable, match=r"no NPU visible \(test\)"):
        backend.load()


def test_every_op_is_registered_when_a_device_is_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_backend import device
    from lmcache_backend.ops import OP_NAMES, _load_backend, implementations

    backend = import_ascend_backend()
    monkeypatch.setattr(device, "npu_unavailable_reason", lambda: None)
    backend.load()
    ops = implementations("ascend")
    assert set(ops) == set(OP_NAMES)
    for name, fn in ops.items():
        assert fn.__name__ == name and fn.__module__.startswith(ASCEND_MODULE)
    loaded = _load_backend("ascend")
    assert dict(loaded.served_by) == dict.fromkeys(OP_NAMES, "ascend")
    assert set(loaded.verifiers) <= set(OP_NAMES)


_ACCELERATORS = ("cuda", "npu")


def _names_accelerator(node: ast.AST) -> bool:
    """A string constant naming an accelerator device: ``"cuda"``, ``"npu:0"``, ..."""
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"(cuda|npu)(:\d+)?", node.value) is not None
    )


def device_literals(source: str, filename: str = "<string>") -> list[str]:
    """Code (not comments or docstrings) that pins tensors to one accelerator: ``.cuda(...)`` /
    ``.npu(...)`` calls, ``device="cuda"`` keywords, ``torch.device("npu")``, ``.to("cuda:0")``
    and ``"npu:0"`` style strings."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        found = False
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _ACCELERATORS:
                found = True  # x.cuda() / x.npu()
            elif isinstance(func, ast.Attribute) and func.attr in ("device", "to"):
                found = any(_names_accelerator(a) for a in node.args)
            found = found or any(
                kw.arg == "device" and _names_accelerator(kw.value) for kw in node.keywords
            )
        elif _names_accelerator(node) and ":" in node.value:
            found = True  # "cuda:0" anywhere in code
        if found:
            hits.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return hits


def _device_literals(paths: list[Path]) -> list[str]:
    hits = []
    for path in paths:
        hits += device_literals(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return hits


def test_device_literal_check_catches_the_usual_forms() -> None:
    for line in (
        "x.cuda()",
        "y = t.npu(0)",
        'torch.zeros(3, device="cuda")',
        "torch.device('npu')",
        'x.to("cuda:1")',
        'DEV = "npu:0"',
    ):
        assert device_literals(line), line
    clean = [
        "torch.cuda.is_available()",
        "torch.zeros(3, device=x.device)",
        'ok = platform == "npu"',
        'def f():\n    """Tensors live on "cuda:0" or "npu:0"; never x.cuda()."""',
        "# x.cuda()",
    ]
    for line in clean:
        assert not device_literals(line), line


def test_shared_code_has_no_device_literals() -> None:
    files = [p for p in (ROOT / "lmcache_backend").rglob("*.py") if "backends" not in p.parts]
    assert files, "no shared modules found"
    assert _device_literals(files) == []


def test_ascend_backend_has_no_device_literals() -> None:
    files = sorted((ROOT / "backends" / "ascend").rglob("*.py"))
    assert files
    assert _device_literals(files) == []


def test_only_the_accessor_imports_torch_npu() -> None:
    importers = [
        p.name
        for p in sorted((ROOT / "backends" / "ascend").rglob("*.py"))
        if re.search(r"^\s*(import torch_npu|from torch_npu)", p.read_text(), re.M)
    ]
    assert importers == ["_npu.py"]


def test_importing_the_package_does_not_import_torch_npu(tmp_path: Path) -> None:
    # A stand-in torch_npu on the path: if anything imported it, it would land in sys.modules.
    (tmp_path / "torch_npu.py").write_text("IMPORTED = True\n")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        sys.path.insert(0, {str(ROOT)!r})
        import lmcache_backend
        import lmcache_backend.ops
        from lmcache_backend.ops import get_ops
        get_ops("torch")
        import lmcache_backend.backends.ascend
        import importlib.util
        assert importlib.util.find_spec("torch_npu") is not None  # the stand-in is findable
        print("torch_npu" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
