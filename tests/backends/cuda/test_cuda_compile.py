"""Every Triton kernel compiles for real GPUs, without one: ahead of time, to a cubin.

The interpreter runs kernels as numpy code, so it cannot see what only the GPU compiler checks:
dot operand shapes and dtypes, layout conversions, and shared memory use. Triton's NVIDIA
backend ships ``ptxas``, so the kernels are compiled here for sm_86 (99 KB of shared memory per
block, the tightest of the common targets) and sm_90, in a fresh interpreter without
``TRITON_INTERPRET`` (under the interpreter ``triton.jit`` does not build compilable kernels).
This includes the bf16 tensor-core attention path that the interpreter cannot run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from repo_paths import REPO_ROOT

# Shared memory per block available to a kernel, in bytes (CUDA programming guide, table of
# compute-capability limits): 99 KB on sm_86, 227 KB on sm_90.
SHARED_LIMIT = {86: 99 * 1024, 90: 227 * 1024}

COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmcache_backend.backends.cuda import (attention, attention_tiling, deviation,
                                           paged_attention, paged_kv, rope, rows)

def compile_one(fn, ptrs, consts, arch, floats=(), options=None):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options or {})
    return kernel.metadata.shared

results = {}
for arch in (86, 90):
    jobs = {
        "rope": (rope._rope_rerotate_k_kernel,
                 {"k_ptr": "*bf16", "old_pos_ptr": "*i64", "new_pos_ptr": "*i64",
                  "cs_ptr": "*fp32"},
                 {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_ROWS": 64, "IS_NEOX": False}),
        "deviation": (deviation._kv_deviation_kernel,
                      {"fresh_ptr": "*bf16", "cached_ptr": "*bf16", "valid_ptr": "*u8",
                       "out_ptr": "*fp32"},
                      {"BLOCK_T": 16, "BLOCK_F": 256}),
        "gather": (rows._gather_rows_kernel,
                   {"src_ptr": "*bf16", "idx_ptr": "*i64", "dst_ptr": "*bf16"},
                   {"BLOCK_N": 4, "BLOCK_F": 1024}),
        "scatter": (rows._scatter_rows_kernel,
                    {"dst_ptr": "*bf16", "idx_ptr": "*i64", "src_ptr": "*bf16"},
                    {"BLOCK_N": 4, "BLOCK_F": 1024}),
        "paged_write": (paged_kv._paged_kv_write_kernel,
                        {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16",
                         "value_cache_ptr": "*bf16", "slot_ptr": "*i64"},
                        {"HEAD_DIM": 128, "BLOCK_T": 4, "BLOCK_F": 1024}),
        "paged_read": (paged_kv._paged_kv_read_kernel,
                       {"key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16", "slot_ptr": "*i64",
                        "key_ptr": "*bf16", "value_ptr": "*bf16"},
                       {"HEAD_DIM": 128, "BLOCK_T": 4, "BLOCK_F": 1024}),
    }
    for name, (fn, ptrs, consts) in jobs.items():
        results[f"{name}-sm{arch}"] = compile_one(fn, ptrs, consts, arch)
    for dtype, head_dim in (("bf16", 128), ("fp16", 256), ("fp32", 256)):
        fp32 = dtype == "fp32"
        # the tilings the launchers choose: short and long prompts, the paged kernel's
        tilings = {
            "attention": attention_tiling.default_tiling(head_dim, head_dim, fp32),
            "attention-long": attention_tiling.default_tiling(head_dim, head_dim, fp32, 1 << 20),
            "paged-attention": attention_tiling.default_paged_tiling(head_dim, head_dim, fp32),
        }
        for name, t in tilings.items():
            tiles = {"HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "BLOCK_M": t.block_m,
                     "BLOCK_N": t.block_n, "DOT_FP32": fp32, "SPLIT": t.split,
                     "HEAVY_FIRST": t.heavy_first}
            options = {"num_warps": t.num_warps, "num_stages": t.num_stages}
            if name.startswith("paged"):
                fn = paged_attention._paged_attention_kernel
                ptrs = {"q_ptr": f"*{dtype}", "kc_ptr": f"*{dtype}", "vc_ptr": f"*{dtype}",
                        "table_ptr": "*i64", "pos_ptr": "*i64", "out_ptr": f"*{dtype}"}
                consts = {**tiles, "BLOCK_SIZE": 16, "PREFETCH": t.prefetch}
            else:
                fn = attention._attention_at_positions_kernel
                ptrs = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                        "pos_ptr": "*i64", "out_ptr": f"*{dtype}"}
                consts = {**tiles, "WINDOWED": False}
                # the tensor memory accelerator's loads where the tiling asks and the GPU has
                # them (Hopper); pointer loads elsewhere
                if t.tma and arch >= 90:
                    desc = f"tensordesc<{dtype}[{t.block_n}, {head_dim}]>"
                    ptrs.update(k_desc=desc, v_desc=desc)
                    consts["TMA"] = True
                else:
                    consts.update(TMA=False, k_desc=None, v_desc=None)
            results[f"{name}-{dtype}-d{head_dim}-sm{arch}"] = compile_one(
                fn, ptrs, consts, arch, floats=("qk_scale_log2",), options=options
            )
print(json.dumps(results))
"""


def test_kernels_compile_for_sm86_and_sm90(tmp_path):
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A fresh cache: really compile, and leave the user's Triton cache alone.
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences Triton 3.9's notice; fusion is the default
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(shared) == 2 * (6 + 3 * 3)
    for name, nbytes in shared.items():
        arch = int(name.rsplit("sm", 1)[1])
        assert nbytes <= SHARED_LIMIT[arch], f"{name} needs {nbytes} B of shared memory"
