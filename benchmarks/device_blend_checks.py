"""How ``benchmarks/device_blend.py`` judges a blend: its K/V and last-token logits against the
model's bf16 and fp32 full prefills, the timed rounds against full prefill, and one round under
torch's profiler."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from device_blend_setup import QUESTION, Bench, Shape, build_model


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def compare_logits(blend: torch.Tensor, full: torch.Tensor) -> dict:
    """Relative error, whether the argmax agrees, and KL(full || blend) of two ``[V]``."""
    log_full, log_blend = full.log_softmax(-1), blend.log_softmax(-1)
    kl = float((log_full.exp() * (log_full - log_blend)).sum())
    return {
        "logits_rel_err": relative_error(blend, full),
        "top1_agrees": bool(blend.argmax() == full.argmax()),
        "kl": kl,
    }


@dataclass
class Reference:
    """The model's full prefill of one prompt in fp32 (the same weights): per-layer ``[T, Hkv,
    D]`` K/V and the last token's logits ``[V]``, and how far the bf16 full prefill is from it
    (``kv_err``: worst layer; ``logits_err``) -- the error a bf16 prefill carries anyway."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    kv_err: float
    logits_err: float


def fp32_reference(model: torch.nn.Module, shape: Shape, ids: list[int]) -> Reference:
    """Full prefill of ``ids`` by an fp32 copy of ``model`` (built, loaded, used, dropped), and
    the bf16 full prefill's distance from it."""
    from lmcache_backend.integration.hf.engine import hf_full_prefill

    device = model.device
    wide = build_model(shape, str(device), torch.float32)
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = hf_full_prefill(wide, ids)
    del wide
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with torch.no_grad():
        full = hf_full_prefill(model, ids)
    kv_err = _worst_layer(full.keys, full.values, ref.keys, ref.values, len(ids))
    return Reference(
        ref.keys, ref.values, ref.logits, kv_err, relative_error(full.logits, ref.logits)
    )


def _worst_layer(keys, values, want_keys, want_values, rows: int) -> float:
    """The largest relative error of any layer's K or V (first ``rows`` rows); NaN if any is."""
    errors = [
        relative_error(got[:rows].float(), want[:rows].float())
        for pair in ((keys, want_keys), (values, want_values))
        for got, want in zip(*pair)
    ]
    return float("nan") if any(e != e for e in errors) else max(errors)


#: the blend at ratio 1.0 may be this many times as far from the fp32 prefill as the bf16 full
#: prefill is: the same arithmetic in bf16, rounded in other orders (tiled online softmax and
#: per-layer kernels against SDPA)
AGREEMENT_FACTOR = 2.0


def agreement(bench: Bench, asked: list[int], ratio: float | None, ref: Reference) -> dict:
    """Blend ``asked`` at ``ratio``; its K/V and last-token logits against the bf16 full
    prefill's and the fp32 reference's."""
    from lmcache_backend.integration.hf.engine import hf_full_prefill

    got = bench.blend(asked, ratio, f"agree-{ratio}")
    keys, values = bench.blended_kv(asked)
    logits, _ = bench.question_logits(asked, keys, values)
    with torch.no_grad():
        full = hf_full_prefill(bench.model, asked)
    end = len(asked) - QUESTION
    return {
        "ratio": ratio,
        "kv_rel_err": _worst_layer(keys, values, full.keys, full.values, end),
        **compare_logits(logits, full.logits),
        "kv_err_fp32": _worst_layer(keys, values, ref.keys, ref.values, end),
        "logits_err_fp32": relative_error(logits, ref.logits),
        "bf16_kv_err_fp32": ref.kv_err,
        "bf16_logits_err_fp32": ref.logits_err,
        "token_layer_fraction": got["token_layer_fraction"],
    }


def agrees(entry: dict) -> bool:
    """At ratio 1.0: the blend is no farther from the fp32 prefill than
    :data:`AGREEMENT_FACTOR` times the bf16 full prefill, and picks its next token."""
    return (
        entry["kv_err_fp32"] <= AGREEMENT_FACTOR * entry["bf16_kv_err_fp32"]  # NaN fails
        and entry["logits_err_fp32"] <= AGREEMENT_FACTOR * entry["bf16_logits_err_fp32"]
        and entry["top1_agrees"]
    )


def timing(bench: Bench, asked_rounds: list[list[int]]) -> dict:
    """Round 0 untimed, then blend + question against full prefill, interleaved."""
    runs: dict[str, list[dict]] = {"full prefill": [], "CacheBlend": []}
    for i, asked in enumerate(asked_rounds):
        full = bench.full_prefill(asked)
        full.pop("logits")
        blend = bench.blend(asked, None, f"timed-{i}")
        keys, values = bench.blended_kv(asked)
        _, question_s = bench.question_logits(asked, keys, values)
        del keys, values
        blend["question_seconds"] = question_s
        blend["seconds"] += question_s
        if i > 0:
            runs["full prefill"].append(full)
            runs["CacheBlend"].append(blend)
    return runs


def gpu_profile(fn) -> dict:
    """``fn()`` under torch's profiler: wall ms, the GPU kernels' summed ms and count, and the
    five ops with the most GPU time. Kernels summing to far less than the wall time mean the
    host's launches set the pace."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_op = sorted(
        prof.key_averages(), key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True
    )
    return {
        "wall_ms": 1000 * wall,
        "kernel_ms": sum(e.device_time for e in kernels) / 1000,
        "kernels": len(kernels),
        "top": [
            [e.key[:60], round(getattr(e, "self_device_time_total", 0) / 1000, 2)]
            for e in by_op[:5]
        ],
    }


def counted(bench: Bench, asked: list[int]) -> dict:
    """One blend (the default ratio) and one full prefill of ``asked`` under the launch counter
    (untimed: the counter slows the host), each with its kernel launches and host-device
    syncs; on CUDA also the syncs torch's sync debug mode reports during the blend."""
    from lmcache_backend.bench.profiling.launch_count import LaunchCounter, cuda_syncs

    with cuda_syncs() as seen, LaunchCounter() as blend:
        bench.blend(asked, None, "counted")
    with LaunchCounter() as full:
        bench.full_prefill(asked)
    return {
        "CacheBlend": {**blend.counts.as_dict(), "cuda_syncs": len(seen)},
        "full prefill": full.counts.as_dict(),
    }
