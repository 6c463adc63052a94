"""Token selectors: which reusable tokens a check layer recomputes.

A selector scores every active token from what the blender knows at a check layer; the blender
keeps the ``ratio * num_reusable`` valid tokens with the highest scores, plus every uncached token
(the query, new chunks) and the last token. ``blend_selection`` (``LMCACHE_BLEND_SELECTION``)
names the selector:

``kv_deviation``
    LMCache's CacheBlend: ``||k_fresh - k_cached||^2`` at the check layer. Runs the ops
    backend's fused ``kv_deviation_topk``.
``kv_deviation_v``
    The same with the values' deviation added, each normalised by its mean over the valid tokens
    (K and V have different scales).
``query_attention``
    How much the query (the tokens after the last reusable one: the question and the assistant
    header) attends to each token, summed over heads, query tokens and every layer up to the check
    layer (layers the blender computes for every token, so these are full-prefill attentions).
    Tokens the question reads are recomputed whether or not their cached K/V drifted.
``query_kv_deviation``
    The product of the two: tokens whose cached K/V drifted *and* that the question reads.
``query_preview``
    No check layer: a preview pass runs the query tokens alone through every layer over the
    cached K/V (what naive reuse computes), and the reusable tokens that contribute most to the
    query's attention outputs (attention mass times the token's value norm, summed over layers)
    are recomputed in every layer of the blend (the final ratio of
    ``blend_recompute_ratios``; ``blend_check_layers`` is not used). The preview costs the query's
    tokens times the layers; its re-rotated cached K/V serve the blend.
``query_preview_last``
    The same preview, scored by the query tokens' value-weighted mass (as ``query_preview``)
    plus the *last* prompt token's alone (the token whose hidden state gives the first output
    token), each divided by its total over the tokens that can be chosen: the last token's
    reads count as much as all the query tokens' together.

``query_preview_stale``
    ``query_preview_last``'s score times the token's staleness, as the store recorded it: 0 for
    a segment computed after exactly what precedes it now, its context distance otherwise, times
    the token's staleness prior where its entry holds one
    (:mod:`lmcache_backend.blend.selectors.staleness`).

The preview selections divide each token's score by ``1 + d * (p + 1) / P`` (``p`` its position,
``P`` the prompt's length, ``d`` = ``blend_position_discount``, default 10): a token at the end
of the prompt needs 11 times the score of one at the start. Late tokens cost more to recompute
(a query at position ``p`` reads ``p + 1`` keys), and on the dev set the discount also gave
answers closer to full prefill (docs/quality.md, "Position discount").

Two settings of the preview selections, off by default (they help Gemma 3 and cost SmolLM2,
docs/quality.md): ``blend_chunk_head_tokens`` ``k`` recomputes the first ``k`` tokens of every
reused chunk before the best-scored ones (:func:`chunk_heads`, :func:`heads_first`), and
``blend_preview_scored_from`` ``s`` scores only the reads of layers from ``s`` of the depth on
(:func:`first_scored_layer`). On a model with sliding-window layers the preview scores only the
layers that see the whole prompt (``blend_preview_scored_layers="global"``, the default,
:func:`scored_layers`): a window shorter than the prompt reads only its end.

With ``blend_selection_span`` ``s > 1`` the preview selections rank aligned spans of ``s``
tokens by their summed score and recompute the best spans whole (:func:`span_ranked`): the same
number of tokens in runs, which vLLM's CPU attention computes for less per pair, at a measured
cost in answers (docs/measurements/spans.md; the default is 1).

Scores are per token ``[N]`` fp32; with tensor parallelism each rank sees only its heads, so the
blender sums scores over ranks (``score_reducer``) before choosing, and every rank keeps the same
tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmcache_backend.ops.reference import token_deviation
from lmcache_backend.settings import PREVIEW_SELECTION_CHOICES

#: The selection that previews the query over the cached K/V instead of checking a layer.
QUERY_PREVIEW = "query_preview"

#: ``query_preview`` with the last token's mass weighted up.
QUERY_PREVIEW_LAST = "query_preview_last"

#: ``query_preview_last``'s score times each token's staleness (blend/selectors/staleness.py).
QUERY_PREVIEW_STALE = "query_preview_stale"

#: The selections that run the preview pass.
PREVIEW_SELECTIONS = frozenset(PREVIEW_SELECTION_CHOICES)

#: Selections that need the query's attention at the layers before (and at) the check layer.
NEEDS_QUERY_ATTENTION = frozenset({"query_attention", "query_kv_deviation"})


@dataclass
class CheckInputs:
    """What a selector sees at a check layer, for the ``N`` tokens still active.

    Attributes:
        k_fresh, v_fresh: ``[N, Hkv, D]`` computed at this layer.
        k_cached, v_cached: ``[N, Hkv, D]`` cached rows (keys re-rotated to the new positions).
        valid: ``[N]`` bool, True where the cached row is reused.
        query_attention: ``[N]`` fp32 attention mass from the query tokens, summed over heads
            and layers so far; None unless the selection needs it.
    """

    k_fresh: torch.Tensor
    v_fresh: torch.Tensor
    k_cached: torch.Tensor
    v_cached: torch.Tensor
    valid: torch.Tensor
    query_attention: torch.Tensor | None = None


def _normalised(deviation: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``deviation`` divided by its mean over valid tokens (1 where there are none)."""
    mean = deviation[valid].mean() if bool(valid.any()) else deviation.new_ones(())
    return deviation / mean.clamp_min(1e-12)


def kv_deviation_scores(inputs: CheckInputs) -> torch.Tensor:
    return token_deviation(inputs.k_fresh, inputs.k_cached)


def kv_deviation_v_scores(inputs: CheckInputs) -> torch.Tensor:
    dk = token_deviation(inputs.k_fresh, inputs.k_cached)
    dv = token_deviation(inputs.v_fresh, inputs.v_cached)
    return _normalised(dk, inputs.valid) + _normalised(dv, inputs.valid)


def query_attention_scores(inputs: CheckInputs) -> torch.Tensor:
    if inputs.query_attention is None:
        raise ValueError("query_attention selection needs the query's attention scores")
    return inputs.query_attention.float()


def query_kv_deviation_scores(inputs: CheckInputs) -> torch.Tensor:
    deviation = token_deviation(inputs.k_fresh, inputs.k_cached)
    return query_attention_scores(inputs) * deviation.sqrt()


SCORERS: dict[str, Callable[[CheckInputs], torch.Tensor]] = {
    "kv_deviation": kv_deviation_scores,
    "kv_deviation_v": kv_deviation_v_scores,
    "query_attention": query_attention_scores,
    "query_kv_deviation": query_kv_deviation_scores,
}


def query_attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention probability mass each key receives from the queries ``q``.

    Args:
        q: ``[Nq, Hq, D]`` queries (the query tokens), ``k``: ``[Nk, Hkv, D]`` keys of the
            whole prompt (row ``j`` is position ``j``), GQA when ``Hq`` is a multiple of ``Hkv``.
        q_positions: ``[Nq]`` positions of the queries; a query at ``p`` sees keys ``0..p``.
        scale: softmax scale.
        window: a sliding window: the query at ``p`` sees keys ``p - window + 1 .. p`` only.
        hidden: ``[T]`` bool, keys no query sees (rows whose K/V are neither cached nor
            computed by this pass), or None.

    Returns:
        ``[Nk]`` fp32: ``sum over heads and queries of softmax(q k^T * scale)`` (each query and
        head contributes a distribution summing to one).
    """
    num_q, num_heads, _ = q.shape
    if num_q == 0:
        return torch.zeros(k.shape[0], dtype=torch.float32, device=k.device)
    group = num_heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [Nk, Hq, D]
    logits = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    key_pos = torch.arange(k.shape[0], device=k.device)
    mask = key_pos[None, :] > q_positions.to(k.device)[:, None]
    if window is not None:
        mask |= key_pos[None, :] <= q_positions.to(k.device)[:, None] - window
    logits = logits.masked_fill(mask[None], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(0, 1))


@dataclass(frozen=True)
class QueryMasks:
    """What :func:`attention_with_query_mass` masks, as one additive term: the same in every
    layer of a pass, so a layer loop builds it once (:func:`query_masks`).

    Attributes:
        bias: ``[N, T]`` fp32, 0 where query ``i`` reads key ``j`` and ``-inf`` where it does
            not (its future, outside its window, a zero row no pass computed): added to the
            logits, one pass over them.
        tail: the query rows are the last rows of ``q`` (the preview's case: a slice).
    """

    bias: torch.Tensor
    tail: bool = False


def query_masks(
    q_positions: torch.Tensor,
    num_keys: int,
    query_rows: torch.Tensor,
    window: int | None = None,
    hidden: torch.Tensor | None = None,
) -> QueryMasks:
    """The masks of :func:`attention_with_query_mass` for queries at sorted ``q_positions [N]``
    over ``num_keys`` keys, summing the mass of ``query_rows [M]``, with a sliding ``window``.
    ``hidden``: ``[T]`` bool keys no query reads, whose K and V rows are finite (uncached rows a
    preview leaves out, zero there): masked here, so no layer passes over them again (rows that
    may hold any value go to :func:`attention_with_query_mass`'s ``hidden`` instead)."""
    positions = q_positions.to(torch.int64)[:, None]
    n, m = positions.shape[0], query_rows.numel()
    keys = torch.arange(num_keys, device=positions.device)[None, :]
    unread = keys > positions  # [N, T]
    if window is not None:  # keys that fell out of the query's window
        unread |= keys <= positions - window
    if hidden is not None:
        unread |= hidden.to(positions.device)[None, :]
    bias = torch.zeros(unread.shape, dtype=torch.float32, device=positions.device)
    bias.masked_fill_(unread, float("-inf"))
    tail = bool(m) and int(query_rows[0]) == n - m and int(query_rows[-1]) == n - 1
    return QueryMasks(bias, tail)


def attention_with_query_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    query_rows: torch.Tensor,
    window: int | None = None,
    hidden: torch.Tensor | None = None,
    masks: QueryMasks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact-mask attention and, from the same probabilities, the mass the query rows (and the
    last row alone) put on each key: the preview pass computes them at every layer, in one go.

    Args:
        q: ``[N, Hq, D]`` queries at sorted ``q_positions [N]``; ``k``, ``v``: ``[T, Hkv, D]``
            (row ``j`` is position ``j``; ``Hq`` a multiple of ``Hkv``).
        scale: softmax scale.
        query_rows: ``[M]`` int64 rows of ``q`` whose attention mass is summed.
        window: a sliding window: the query at ``p`` sees keys ``p - window + 1 .. p`` only.
        hidden: ``[T]`` bool, keys no query sees (rows whose K/V are neither cached nor
            computed by this pass), or None.
        masks: :func:`query_masks` of these positions, keys, rows and window, built once for
            a pass (None: built here).

    Returns:
        ``([N, Hq, D]`` attention output in ``q.dtype``, ``[T]`` fp32 mass of the query rows,
        ``[T]`` fp32 mass of the last row: what
        :func:`lmcache_backend.ops.reference.attention_at_positions` and
        :func:`query_attention_mass` of ``q[query_rows]`` and ``q[-1:]`` give.)

    Softmax and masses are fp32. With bf16/fp16 keys the two matrix products run in that dtype
    (2-4x faster than fp32 on CPU, and the engine's own attention multiplies in it too): the
    logits are rounded to it before the fp32 softmax, about 0.4% relative error in bf16.
    """
    n, num_heads, dim = q.shape
    num_keys, kv_heads = k.shape[0], k.shape[1]
    group = num_heads // kv_heads
    if n == 0:
        zeros = torch.zeros(num_keys, device=k.device)
        return q.new_empty(0, num_heads, v.shape[-1]), zeros, zeros.clone()
    if masks is None:
        masks = query_masks(q_positions.to(k.device), num_keys, query_rows, window)
    mm = k.dtype if k.dtype in (torch.bfloat16, torch.float16) else torch.float32
    # grouped-query heads side by side: head h reads KV head h // group. Head-major contiguous
    # K/V keep both batched matmuls on the BLAS fast path (a permuted view was 3x slower).
    qs = (q.float() * scale).to(mm)
    qs = qs.view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    kh = k.to(mm).transpose(0, 1).contiguous()  # [Hkv, T, D]
    vh = v.to(mm).transpose(0, 1).contiguous()
    logits = torch.bmm(qs, kh.transpose(1, 2)).float()  # [Hkv, N * group, T]
    logits = logits.view(kv_heads, n, group, num_keys)
    logits.add_(masks.bias[None, :, None, :])
    if hidden is not None:  # their rows may hold anything, even non-finite values
        hidden = hidden.to(k.device)
        logits.masked_fill_(hidden[None, None, None, :], float("-inf"))
        vh = vh.masked_fill(hidden[None, :, None], 0)
    probs = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs.view(kv_heads, -1, num_keys).to(mm), vh)
    out = out.view(kv_heads, n, group, -1).permute(1, 0, 2, 3).reshape(n, num_heads, -1)
    if masks.tail:  # the usual case: the tail
        mass = probs[:, n - query_rows.numel() :].sum(dim=(0, 1, 2))
    else:
        mass = probs[:, query_rows.to(k.device)].sum(dim=(0, 1, 2))
    return out.to(q.dtype), mass, probs[:, -1].sum(dim=(0, 1))


def value_norms(values: torch.Tensor) -> torch.Tensor:
    """``[Nk]`` fp32: each token's value norm (``values [Nk, Hkv, D]``), mean over heads. The
    preview weights each token's attention mass by it: how much the token can move the attention
    output, not only how much it is attended to.

    Measured on the dev set (HF engine, fp32, 6 prompts, ratio 0.2): first-token KL 0.048 with
    the weighting against 0.076 with the attention mass alone, at the same token-layers.
    """
    return torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32).mean(dim=-1)


def query_and_last_scores(
    query_mass: torch.Tensor, last_mass: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """``query_preview_last``'s scores: each ``[T]`` mass divided by its sum over the
    ``candidates [T]`` (bool: the tokens the selection may choose), added."""

    def share(mass: torch.Tensor) -> torch.Tensor:
        return mass / mass[candidates].sum().clamp_min(torch.finfo(torch.float32).tiny)

    return share(query_mass) + share(last_mass)


def position_discount(positions: torch.Tensor, discount: float) -> torch.Tensor:
    """``[T]`` fp32 divisors ``1 + discount * (p + 1) / P`` for the prompt's ``positions [T]``
    (``P``: the last position + 1); all ones for ``discount`` 0."""
    p = positions.to(torch.float32) + 1.0
    return 1.0 + discount * p / p.max().clamp_min(1.0)


def span_ranked(scores: torch.Tensor, candidates: torch.Tensor, span: int) -> torch.Tensor:
    """``[T]`` float64 keys whose top-k takes whole spans of ``span`` consecutive tokens.

    The prompt is cut into aligned spans (tokens ``s * span .. s * span + span - 1``); a span's
    score is the sum of its candidates' ``scores [T]`` (``candidates [T]`` bool: the tokens the
    selection may choose). Keys order tokens by their span's score first (ties: the earlier span)
    and by their own score inside a span, so taking the top ``count`` keys takes the best spans
    whole and only the last one in part, by its tokens' own scores.

    Why: a query run of ``span`` consecutive positions costs vLLM's CPU attention about what a
    full prefill pays per query-key pair, an isolated query 1.5x that (docs/measurements/spans.md).
    """
    num = scores.numel()
    own = torch.where(candidates, scores, torch.zeros_like(scores)).double().clamp_min(0.0)
    span_of = torch.arange(num, device=scores.device) // span
    num_spans = int(span_of[-1]) + 1 if num else 0
    totals = torch.zeros(num_spans, dtype=torch.float64, device=scores.device)
    totals.index_add_(0, span_of, own)
    order = torch.sort(totals, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_spans, device=scores.device)
    # whole numbers apart per span rank; the own score (< 0.5 of that gap) orders inside a span
    inside = own / own.max().clamp_min(torch.finfo(torch.float64).tiny) * 0.5
    return (num_spans - rank[span_of]).double() + inside


def chunk_heads(starts_and_lengths: list[tuple[int, int]], num_tokens: int, k: int) -> torch.Tensor:
    """``[T]`` bool: the first ``k`` tokens of every reused chunk (``(start, length)`` each)."""
    heads = torch.zeros(num_tokens, dtype=torch.bool)
    for start, length in starts_and_lengths:
        heads[start : start + min(k, length)] = True
    return heads


def heads_first(scores: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """``scores [T]`` with every ``heads`` token ranked above every other (in their own order
    among themselves), so a top-k takes the heads before anything else."""
    # a head at -m lifted by 2m + 1 lands above every other score (at most m)
    return torch.where(heads, scores + 2 * scores.abs().max() + 1, scores)


def first_scored_layer(share: float, num_layers: int) -> int:
    """The first layer whose reads the preview scores: ``share`` of the model's depth."""
    return min(int(share * num_layers), num_layers - 1)


def scored_layers(
    windows: Sequence[int | None], num_tokens: int, first: int, which: str
) -> list[bool]:
    """Per layer, whether the preview scores its reads: from layer ``first`` on and, with
    ``which="global"``, only the layers that attend over the whole ``num_tokens``-token prompt
    (no sliding window, or one at least that long), unless none of those does; ``"all"``:
    every layer from ``first`` on.

    Args:
        windows: each layer's sliding window (None: none).
    """
    from_first = [layer >= first for layer in range(len(windows))]
    if which == "all":
        return from_first
    whole = [f and (w is None or w >= num_tokens) for f, w in zip(from_first, windows)]
    return whole if any(whole) else from_first
