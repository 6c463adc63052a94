"""EMULATION of the torch_npu operators the Ascend backend calls. This is NOT torch_npu.

Plain torch on CPU, written from each operator's documented contract (argument names, layouts,
dtypes, mask convention, documented limits), so the Ascend backend's use of those operators can be
checked without an NPU. Agreement with this module shows the backend calls the operators as
documented; it does not show the operators behave as documented:
``tests/backends/ascend/test_ascend_npu.py`` checks that on a device.

Where a documented limit is violated the emulation raises instead of computing, so a backend call
that the real operator would reject fails here too. ``CALLS`` counts calls per operator, so tests
can tell a fused path from a fallback.

Sources (op-plugin is torch_npu's operator repository, docs/context/<op>.md):

- ``npu_rotary_mul``: "torch_npu.npu_rotary_mul", Ascend/op-plugin
  docs/context/torch_npu-npu_rotary_mul.md; also hiascend.com PyTorch 7.0.0 API reference
  https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000141.html
- ``npu_fused_infer_attention_score``: "torch_npu.npu_fused_infer_attention_score",
  Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md; also
  https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000837.html
- ``npu_scatter_nd_update_``: "torch_npu.npu_scatter_nd_update_", Ascend/op-plugin
  docs/context/torch_npu-npu_scatter_nd_update_.md
- ``_npu_reshape_and_cache``: private operator without an API page; its contract is taken from
  its tests in Ascend/op-plugin test/test_custom_ops/test_atb_reshape_and_cache.py (ND cache
  ``[num_blocks, block_size, N, D]``, negative slots skipped, int32 slots) and its caller
  vllm-project/vllm-ascend vllm_ascend/attention/attention_v1.py (keyword names, "torch_npu
  requires int32 for slot_indices", cache shape from ``get_kv_cache_shape``).
"""

from __future__ import annotations

from collections import Counter

import torch

CALLS: Counter[str] = Counter()

# The documented Ascend mask convention: True / 1 = this query-key pair is masked out (not
# computed). Tests flip this to show that a wrong convention is caught.
MASK_TRUE_MEANS_MASKED = True

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class EmulatedOpError(RuntimeError):
    """A call the documented operator contract does not allow."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise EmulatedOpError(message)


# --------------------------------------------------------------------------- npu_rotary_mul


def _rotary_layouts(shape: torch.Size, rotary_mode: str) -> dict[str, tuple]:
    """Per input layout: ``(B, N, allowed r1/r2 shapes)`` as documented for a 4-D input on
    Atlas A2/A3 (jit_compile=False).

    half: BNSD -> 11SD/B1SD/BNSD, BSND -> 1S1D/BS1D/BSND, SBND -> S11D/SB1D/SBND;
    interleave: BNSD -> 11SD, BSND -> 1S1D, SBND -> S11D only.
    """
    a, b, c, d = shape
    if rotary_mode == "interleave":
        return {
            "BNSD": (a, b, {(1, 1, c, d)}),
            "BSND": (a, c, {(1, b, 1, d)}),
            "SBND": (b, c, {(a, 1, 1, d)}),
        }
    return {
        "BNSD": (a, b, {(1, 1, c, d), (a, 1, c, d), (a, b, c, d)}),
        "BSND": (a, c, {(1, b, 1, d), (a, b, 1, d), (a, b, c, d)}),
        "SBND": (b, c, {(a, 1, 1, d), (a, b, 1, d), (a, b, c, d)}),
    }


def npu_rotary_mul(
    input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    """``output = r1 * input + r2 * rotate(input)``, shape and dtype of ``input``.

    half: ``rotate(x) = cat(-x2, x1)`` with ``x1, x2 = chunk(x, 2, -1)``;
    interleave: ``rotate(x)[2i] = -x[2i+1]``, ``rotate(x)[2i+1] = x[2i]``.
    """
    CALLS["npu_rotary_mul"] += 1
    _require(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r}")
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        _require(t.dim() == 4, f"{name} must be 4-D, got {tuple(t.shape)}")
        _require(t.dtype in _FLOATS, f"{name} dtype {t.dtype}")
    d = input.shape[-1]
    _require(d % 2 == 0 and d < 896, f"D = {d} must be even and < 896")
    _require(r1.shape == r2.shape, "r1 and r2 shapes differ")
    _require(
        bool((r1.abs() <= 1).all() and (r2.abs() <= 1).all()),
        "r1/r2 outside the documented range [-1, 1]",
    )
    fits = [
        (batch, heads)
        for batch, heads, shapes in _rotary_layouts(input.shape, rotary_mode).values()
        if tuple(r1.shape) in shapes
    ]
    _require(bool(fits), f"r1 shape {tuple(r1.shape)} not allowed for {rotary_mode} mode")
    if rotary_mode == "interleave":
        _require(any(b * n < 1000 for b, n in fits), "B * N must be < 1000")
    else:
        _require(any(b < 1000 and n < 1000 for b, n in fits), "B and N must be < 1000")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).reshape(x.shape)
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)


# ----------------------------------------------------------- npu_fused_infer_attention_score


def _mask_to_4d(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Documented mask shapes (Q_S, KV_S), (B|1, Q_S, KV_S), (B|1, 1, Q_S, KV_S) -- and for
    Q_S == 1 also (B, KV_S), (B, 1, KV_S) -- as bool ``[B|1, 1, Q_S, KV_S]``; a mask padded up
    to an aligned S is cut back."""
    _require(mask.dtype in (torch.bool, torch.int8, torch.uint8), f"atten_mask dtype {mask.dtype}")
    if q_len == 1 and mask.dim() == 2 and mask.shape[0] == batch and batch > 1:
        mask = mask[:, None, None, :]
    elif q_len == 1 and mask.dim() == 3 and mask.shape[1] == 1 and mask.shape[0] == batch:
        mask = mask[:, None]
    elif mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    _require(mask.dim() == 4 and mask.shape[1] == 1, f"atten_mask shape {tuple(mask.shape)}")
    _require(mask.shape[0] in (1, batch), f"atten_mask batch {mask.shape[0]}")
    _require(mask.shape[2] >= q_len and mask.shape[3] >= kv_len, "atten_mask smaller than Q/KV")
    mask = mask[:, :, :q_len, :kv_len] != 0
    return mask if MASK_TRUE_MEANS_MASKED else ~mask


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: list[int] | None = None,
    actual_seq_lengths_kv: list[int] | None = None,
    block_table: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    softmax_lse_flag: bool = False,
    **unsupported: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``softmax(scale * Q K^T, masked) V`` for the BSND and BNSD layouts.

    Emulated: fp16/bf16 query, key and value of one shape, GQA through ``num_key_value_heads``
    (query head ``h`` reads key head ``h // (num_heads / num_key_value_heads)``; the document
    does not spell the grouping out, this is the one vLLM uses -- checked on a device), explicit
    ``atten_mask`` with ``sparse_mode=0`` (1 = masked out), ``inner_precise`` 0..3 (2 and 3 zero
    rows that are entirely masked, the documented row-invalid correction). Quantisation, paging,
    padding, pse and prefix arguments are not emulated and raise. Returns
    ``(attention_out, softmax_lse)``; ``softmax_lse`` is a ``[1]`` zero without the flag.
    """
    CALLS["npu_fused_infer_attention_score"] += 1
    not_emulated = {k: v for k, v in unsupported.items() if v is not None}
    _require(not not_emulated, f"arguments not emulated: {sorted(not_emulated)}")
    _require(
        pse_shift is None
        and block_table is None
        and actual_seq_lengths is None
        and actual_seq_lengths_kv is None
        and not softmax_lse_flag,
        "pse_shift / block_table / actual_seq_lengths / softmax_lse not emulated",
    )
    _require(sparse_mode == 0, f"sparse_mode {sparse_mode} not emulated")
    _require(inner_precise in (0, 1, 2, 3), f"inner_precise {inner_precise}")
    _require(input_layout in ("BSND", "BNSD"), f"input_layout {input_layout!r} not emulated")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require(t.dim() == 4, f"{name} must be 4-D for {input_layout}")
        _require(t.dtype in (torch.float16, torch.bfloat16), f"{name} dtype {t.dtype}")
        _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(key.shape == value.shape, "key and value shapes must match")
    _require(query.dtype == key.dtype == value.dtype, "query/key/value dtypes differ")
    if input_layout == "BSND":
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> BNSD views
    else:
        q, k, v = query, key, value
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    _require(heads == num_heads, f"num_heads {num_heads} != query N {heads}")
    expected_kv_heads = num_key_value_heads or num_heads
    _require(kv_heads == expected_kv_heads, f"key N {kv_heads} != {expected_kv_heads}")
    _require(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, "GQA ratio")
    _require(heads <= 256 and head_dim <= 512 and head_dim % 16 == 0, "N <= 256, D % 16, D <= 512")
    _require(k.shape[0] == batch and k.shape[3] == head_dim, "key batch / head dim")

    group = num_heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [B, N, Q_S, KV_S]
    if atten_mask is not None:
        masked = _mask_to_4d(atten_mask, batch, q_len, kv_len)
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if inner_precise in (2, 3):
        probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs, vf).to(query.dtype)  # [B, N, Q_S, D]
    if input_layout == "BSND":
        out = out.transpose(1, 2).contiguous()
    return out, torch.zeros(1, dtype=torch.float32)


# -------------------------------------------------------------------- npu_scatter_nd_update_

_SCATTER_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bool,
    torch.bfloat16,
    torch.int64,
    torch.int8,
)


def npu_scatter_nd_update_(
    input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor
) -> torch.Tensor:
    """In place ``input[tuple(indices[i])] = updates[i]``; returns ``input``.

    ``indices [..., a]`` (int32/int64, at least 2-D, in range) addresses the first ``a`` dims;
    ``updates`` has shape ``indices.shape[:-1] + input.shape[a:]`` and ``input``'s dtype.
    """
    CALLS["npu_scatter_nd_update_"] += 1
    _require(1 <= input.dim() <= 8, "input must be 1-D to 8-D")
    _require(input.dtype in _SCATTER_DTYPES, f"input dtype {input.dtype}")
    _require(updates.dtype == input.dtype, "updates dtype must equal input dtype")
    _require(indices.dtype in (torch.int32, torch.int64), f"indices dtype {indices.dtype}")
    _require(indices.dim() >= 2, "indices must be at least 2-D")
    depth = indices.shape[-1]
    _require(depth <= input.dim(), "indices last dim exceeds input dims")
    expected = tuple(indices.shape[:-1]) + tuple(input.shape[depth:])
    _require(tuple(updates.shape) == expected, f"updates {tuple(updates.shape)} != {expected}")
    flat_idx = indices.reshape(-1, depth).long()
    bounds = torch.tensor(input.shape[:depth], dtype=torch.long)
    _require(bool(((flat_idx >= 0) & (flat_idx < bounds)).all()), "indices out of range")
    input[tuple(flat_idx.t())] = updates.reshape(-1, *input.shape[depth:])
    return input


# -------------------------------------------------------------------- _npu_reshape_and_cache


def _npu_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """In place: row ``i`` of ``key``/``value [T, N, D]`` goes to block ``s // block_size``, row
    ``s % block_size`` of the ND caches ``[num_blocks, block_size, N, D]``, ``s =
    slot_indices[i]`` (int32); negative slots are skipped."""
    CALLS["_npu_reshape_and_cache"] += 1
    _require(slot_indices.dtype == torch.int32, f"slot_indices dtype {slot_indices.dtype}")
    _require(slot_indices.dim() == 1 and slot_indices.shape[0] == key.shape[0], "slot count")
    for name, t, cache in (("key", key, key_cache), ("value", value, value_cache)):
        _require(t.dim() == 3, f"{name} must be [T, N, D]")
        _require(cache.dim() == 4, f"{name}_cache must be ND [num_blocks, block_size, N, D]")
        _require(t.dtype in (torch.float16, torch.bfloat16, torch.int8), f"{name} dtype {t.dtype}")
        _require(cache.dtype == t.dtype, f"{name}_cache dtype {cache.dtype} != {t.dtype}")
        _require(tuple(cache.shape[2:]) == tuple(t.shape[1:]), f"{name}_cache N/D mismatch")
    block_size = key_cache.shape[1]
    num_slots = key_cache.shape[0] * block_size
    slots = slot_indices.long()
    keep = slots >= 0
    _require(bool((slots[keep] < num_slots).all()), "slot out of range")
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]
