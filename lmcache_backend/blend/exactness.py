"""Is CacheBlend exact on a model adapter? The checks behind ``lmcache-backend verify``.

* **re-rotation**: keys computed at positions ``p`` and re-rotated to ``p + s`` against keys
  computed at ``p + s`` (relative error), on layer 0, or on the first layer of each kind where
  layers differ (Gemma 3's local and global layers, each with its RoPE table). A RoPE scaling
  the re-rotation mishandles shows up here (e.g. YaRN's attention factor applied twice);
* **ratio 1.0**: recomputing every token must give full prefill's first token (maximum logit
  difference and greedy agreement);
* **default ratio**: the configured setting reuses the chunks (it blended, nothing fell back);
  its agreement with full prefill is reported, not judged (reuse is approximate by design).

The prompts are the built-in RAG examples, their chunks stored in their original order and
then served reordered. The vLLM connector runs these checks at start-up with
``verify_on_start``; :mod:`lmcache_backend.commands.verify` runs them on whole engines.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_backend.blend.blender import LMCBlender
from lmcache_backend.blend.segmenting import build_blend_prompt
from lmcache_backend.blend.segments.segment_cache import SegmentCache
from lmcache_backend.data.examples import builtin_examples, reordered
from lmcache_backend.ops import get_ops
from lmcache_backend.storage.segments import SegmentKV, SegmentStore

logger = logging.getLogger(__name__)

#: Relative error of re-rotated keys allowed per model dtype (the keys are rounded to it).
REROTATION_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
#: Largest first-token logit difference at ratio 1.0 per model dtype (fp32: the same arithmetic
#: in another order; bf16: one rounding of 8 mantissa bits per op, over 30 layers).
LOGIT_TOLERANCE = {torch.float32: 1e-2, torch.float16: 0.5, torch.bfloat16: 1.0}
#: Answers allowed to differ from full prefill at ratio 1.0, per dtype (of the prompts run):
#: fp32 none; half precision one, as two orders of the same rounded sums can flip a near-tie.
DISAGREEMENT_ALLOWED = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 1}


@dataclass
class Check:
    """One check: ``passed`` is None for a reported-only number."""

    name: str
    value: str
    limit: str
    passed: bool | None

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "info"}[self.passed]
        limit = f" (limit {self.limit})" if self.limit else ""
        return f"{verdict:4}  {self.name}: {self.value}{limit}"


def checks_passed(checks: Sequence[Check]) -> bool:
    return all(c.passed is not False for c in checks)


def format_checks(title: str, checks: Sequence[Check]) -> str:
    verdict = "passed" if checks_passed(checks) else "FAILED"
    return "\n".join([f"{title}: {verdict}", *("  " + c.line() for c in checks)])


class InMemoryStore(SegmentStore):
    """A private in-memory store, so a check never touches the engine's segments."""

    def __init__(self) -> None:
        self._d: dict[str, SegmentKV] = {}
        self._lock = threading.Lock()

    def get(self, key: str, num_tokens: int | None = None) -> SegmentKV | None:
        kv = self._d.get(key)
        return kv if kv is None or num_tokens in (None, kv.num_tokens) else None

    def put(self, key: str, kv: SegmentKV) -> bool:
        with self._lock:
            self._d.setdefault(key, kv)
        return True

    def contains(self, key: str) -> bool:
        return key in self._d

    def clear(self) -> None:
        self._d.clear()

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self._d.values())


def tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in REROTATION_TOLERANCE else torch.bfloat16


def builtin_prompts(tokenizer: Any, count: int = 4, separator: str | None = None) -> list:
    """``count`` pairs ``(original, reordered)`` of prompt token ids from the built-in examples."""
    # separator-free mode (""): the default separator only shapes the text, blocks are found in it
    kw = {"blend_special_str": separator} if separator else {}
    pairs = []
    for ex in builtin_examples(count, chunks_per_example=3):
        first = build_blend_prompt(tokenizer, ex.system, ex.chunks, ex.question, **kw)
        again = build_blend_prompt(
            tokenizer, ex.system, reordered(ex.chunks, seed=1), ex.question, **kw
        )
        pairs.append((first.token_ids, again.token_ids))
    return pairs


@torch.inference_mode()
def rerotation_error(
    adapter: Any, token_ids: Sequence[int], shift: int = 97, ops=None, layer: int = 0
) -> float:
    """Relative error of ``layer``'s keys of ``token_ids`` re-rotated from positions ``0..n-1``
    to ``shift..shift+n-1`` (with the layer's rotation table) against the keys the adapter
    computes there."""
    ops = ops or get_ops("torch")
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    x = adapter.attention_input(layer, adapter.embed(ids))
    old = torch.arange(ids.numel(), device=adapter.device)
    new = old + shift
    _, k_old, _ = adapter.qkv(layer, x, old)
    _, k_new, _ = adapter.qkv(layer, x, new)
    moved = k_old.clone()
    ops.rope_rerotate_k(moved, old, new, adapter.rotation_table(layer), adapter.is_neox)
    diff = (moved.double() - k_new.double()).norm()
    return float(diff / k_new.double().norm().clamp_min(1e-30))


def rerotation_checks(adapter: Any, token_ids: Sequence[int], ops=None) -> list[Check]:
    """One re-rotation check per kind of layer (rotation table and window: Gemma 3's local and
    global layers), on its first layer; one check of layer 0 for a model with one kind."""
    limit = REROTATION_TOLERANCE[tolerance_dtype(adapter.dtype)]
    checks = []
    for kind, layer in adapter.layer_kinds():
        err = rerotation_error(adapter, token_ids, ops=ops, layer=layer)
        name = f"re-rotation error ({kind})" if kind else "re-rotation error"
        checks.append(Check(name, f"{err:.2e}", f"{limit:.0e}", bool(err <= limit)))
    return checks


def agreement_checks(
    dtype: torch.dtype,
    label: str,
    logit_diffs: list[float],
    agree: int,
    total: int,
    judged: bool,
) -> list[Check]:
    key = tolerance_dtype(dtype)
    max_diff = max(logit_diffs) if logit_diffs else float("nan")
    logit_limit = LOGIT_TOLERANCE[key]
    allowed = DISAGREEMENT_ALLOWED[key]
    return [
        Check(
            f"{label}: max first-token logit difference",
            f"{max_diff:.3g}",
            f"{logit_limit:g}" if judged else "",
            bool(max_diff <= logit_limit) if judged else None,
        ),
        Check(
            f"{label}: greedy answers equal to full prefill",
            f"{agree}/{total}",
            f">= {total - allowed}/{total}" if judged else "",
            bool(agree >= total - allowed) if judged else None,
        ),
    ]


def reuse_check(label: str, fallbacks: list[str | None], fractions: list[float]) -> Check:
    fell = [f for f in fallbacks if f]
    mean = sum(fractions) / max(len(fractions), 1)
    value = f"{len(fallbacks) - len(fell)}/{len(fallbacks)} blended, {mean:.0%} recomputed"
    return Check(f"{label}: chunks reused", value, "all blended", not fell)


@torch.inference_mode()
def adapter_checks(
    adapter: Any,
    separator: Sequence[int],
    prompts: Sequence[tuple[Sequence[int], Sequence[int]]],
    config: Any,
    *,
    reference: Callable[[Sequence[int]], torch.Tensor] | None = None,
    ops=None,
) -> list[Check]:
    """The checks on a model adapter alone (the connector's start-up check).

    Args:
        adapter: a :class:`~lmcache_backend.models.base.ModelAdapter`.
        separator: the separator's token ids.
        prompts: ``(original, reordered)`` token-id pairs.
        config: a :class:`~lmcache_backend.config.BlendConfig` (its ratios are the default).
        reference: last-token ``[vocab]`` logits of a full prefill; default: the blender's own
            full prefill (every token computed, nothing reused).
        ops: op set (default: the configured backend's).

    Only the first token is compared here (greedy agreement of the first token).
    """
    ops = ops or get_ops(config.backend)
    store = InMemoryStore()
    cfg = config.replace(blend_min_tokens=min(config.blend_min_tokens, 16))
    full_cfg = cfg.replace(blend_recompute_ratios=[1.0])
    blender = LMCBlender(store, None, cfg, adapter, separator, ops)
    segments = SegmentCache(store, adapter.fingerprint, separator)
    checks = rerotation_checks(adapter, prompts[0][1], ops)
    stats = {
        k: {"diffs": [], "agree": 0, "fallbacks": [], "fractions": []}
        for k in ("ratio 1.0", "default")
    }
    for first, again in prompts:
        warm = blender.blend(list(first), torch.zeros(len(first), dtype=torch.bool))
        segments.store_segments(list(first), warm.keys, warm.values)
        if reference is None:
            ref = blender.blend(list(again), torch.zeros(len(again), dtype=torch.bool)).logits
        else:
            ref = reference(again)
        for label, request_cfg in (("ratio 1.0", full_cfg), ("default", cfg)):
            res = blender.blend(list(again), config=request_cfg)
            s = stats[label]
            s["diffs"].append(float((res.logits.float() - ref.float()).abs().max()))
            s["agree"] += int(int(res.logits.argmax()) == int(ref.argmax()))
            s["fallbacks"].append(res.fallback_reason)
            s["fractions"].append(res.recomputed_reusable / max(res.num_reusable, 1))
    for label, s in stats.items():
        judged = label == "ratio 1.0"
        checks += agreement_checks(
            adapter.dtype, label, s["diffs"], s["agree"], len(prompts), judged
        )
        checks[-1].name = f"{label}: first tokens equal to full prefill"
        checks.append(reuse_check(label, s["fallbacks"], s["fractions"]))
    return checks
