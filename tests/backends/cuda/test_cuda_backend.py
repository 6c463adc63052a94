"""Loading the CUDA backend, its availability rule, and calls its verifiers decline.

The declined calls use tensors on :data:`conftest.DEVICE`, so each is declined for the reason it
names (not for sitting on the CPU beside a GPU) and its fallback runs on the GPU when one is
visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from numerics import DEVICE, assert_close
from repo_paths import REPO_ROOT

from lmcache_backend.backends import cuda as cuda_backend
from lmcache_backend.backends.cuda._common import interpret_mode
from lmcache_backend.ops import OP_NAMES, get_ops


def run_python(code: str, **env_changes: str | None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this environment minus/plus ``env_changes``."""
    env = dict(os.environ)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_op_is_served_by_the_kernels():
    ops = get_ops("cuda")
    assert ops.name == "cuda"
    assert dict(ops.served_by) == {op: "cuda" for op in OP_NAMES}
    assert set(ops.verifiers) == set(OP_NAMES)


def test_without_cuda_or_interpreter_get_ops_raises_with_the_reason():
    # CUDA_VISIBLE_DEVICES="" hides a GPU from the child, so this holds on a GPU machine too
    code = (
        "from lmcache_backend.ops import BackendUnavailable, get_ops\n"
        "try:\n"
        "    get_ops('cuda')\n"
        "except BackendUnavailable as exc:\n"
        "    print('UNAVAILABLE:', exc)\n"
        "else:\n"
        "    print('LOADED')\n"
    )
    proc = run_python(code, TRITON_INTERPRET=None, CUDA_VISIBLE_DEVICES="", LMCACHE_BACKEND=None)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out.startswith("UNAVAILABLE:"), out
    assert "no CUDA device" in out and "TRITON_INTERPRET" in out, out


def test_importing_the_backend_does_not_import_triton():
    code = (
        "import json, sys\n"
        "import lmcache_backend, lmcache_backend.ops, lmcache_backend.backends.cuda\n"
        "print(json.dumps('triton' in sys.modules))\n"
    )
    proc = run_python(code, TRITON_INTERPRET=None)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) is False


def test_unavailable_reason_is_none_here():
    assert cuda_backend.unavailable_reason() is None


def test_kernels_are_compiled_on_a_gpu_and_interpreted_on_the_cpu(device: torch.device) -> None:
    """A run on a GPU must check the compiled kernels, not the interpreter (an inherited
    ``TRITON_INTERPRET=1`` would run them in numpy); without a GPU the interpreter runs them."""
    assert interpret_mode() is (device.type == "cpu")


def declined(op: str, *args) -> str:
    get_ops("cuda")
    reason = get_ops("cuda").verifiers[op](*args)
    assert isinstance(reason, str) and reason
    return reason


def test_declined_dtype_still_gives_the_reference_answer():
    """fp64 keys are not served by the RoPE kernel; the op still answers right."""
    gen = torch.Generator().manual_seed(0)
    half = 32
    angles = torch.arange(256, dtype=torch.float64)[:, None] * torch.rand(half, generator=gen)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(DEVICE)
    k = torch.randn(7, 2, 64, generator=gen, dtype=torch.float64).to(DEVICE)
    old = torch.randint(0, 256, (7,), generator=gen).to(DEVICE)
    new = torch.randint(0, 256, (7,), generator=gen).to(DEVICE)
    assert "float64" in declined("rope_rerotate_k", k, old, new, table, True)
    expected = get_ops("torch").rope_rerotate_k(k.clone(), old, new, table, True)
    get_ops("cuda").rope_rerotate_k(k, old, new, table, True)
    assert torch.equal(k, expected)


def test_declined_head_dim_still_gives_the_reference_answer():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 24, generator=gen).to(DEVICE)
    k = torch.randn(40, 2, 24, generator=gen).to(DEVICE)
    v = torch.randn(40, 2, 24, generator=gen).to(DEVICE)
    positions = torch.tensor([0, 3, 17, 30, 39], device=DEVICE)
    assert "power" in declined("attention_at_positions", q, k, v, positions, 0.2)
    result = get_ops("cuda").attention_at_positions(q, k, v, positions, 0.2)
    expected = get_ops("torch").attention_at_positions(q, k, v, positions, 0.2)
    assert_close(result, expected, torch.float32)


def test_declined_layout_still_gives_the_reference_answer():
    """A transposed tensor has no contiguous rows to gather in place."""
    x = torch.randn(64, 63).to(DEVICE).t()
    idx = torch.tensor([62, 0, 5], device=DEVICE)
    assert "contiguous" in declined("gather_rows", x, idx)
    assert torch.equal(get_ops("cuda").gather_rows(x, idx), x[idx])


def test_declined_quantized_cache():
    key = torch.randn(4, 2, 16).to(DEVICE)
    cache = torch.zeros(2, 16, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    assert "quantized" in declined("paged_kv_write", key, key, cache, cache.clone(), slots)
