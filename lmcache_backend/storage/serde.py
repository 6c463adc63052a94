"""Byte format of one stored segment (disk files and Redis values), with integrity checks.

An entry is a safetensors blob: an 8-byte little-endian header length, a JSON header, then the raw
tensor bytes of ``keys`` and then ``values`` (both ``[L, n, Hkv, D]``), and, in a
:data:`FORMAT_V2` entry only, ``staleness`` (``[L, n]`` fp16, the segment's staleness prior). The
header's ``__metadata__`` holds:

======================  =====================================================================
``format``              :data:`FORMAT` (:data:`FORMAT_V2` with a staleness prior)
``key``                 the segment key the entry was stored under
``fingerprint``         hex digest of the model fingerprint (``""`` when the writer had none)
``start_position``      position of the segment's first token when it was computed
``dtype``, ``shape``    torch dtype name and ``[L, n, Hkv, D]``, repeated from the tensors
``checksum``            ``blake2b-256`` of the tensor bytes (keys, values, then staleness)
``context``             optional: digest of the tokens before the segment when it was computed
``preceding``           optional: JSON list of the tags of the stored units before it then
======================  =====================================================================

Provenance (``context``, ``preceding``) is optional metadata of a :data:`FORMAT` entry: entries
written without it read as unknown provenance, and a reader that predates it ignores it. Only an
entry with a staleness prior is written as :data:`FORMAT_V2` (an extra tensor, which a reader
that predates it rejects as not its format, i.e. a miss).

Decoding never unpickles anything: the header is parsed as JSON and checked (key, fingerprint,
dtype, shapes, byte offsets, exact total size, expected model layout) before any tensor is built,
and the checksum is verified over the raw tensor bytes before they are handed to safetensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lmcache_backend.models.fingerprint import ModelFingerprint
from lmcache_backend.storage.segments import SegmentKV

FORMAT = "lmcache_backend.segment.v1"
#: the format of an entry that carries a staleness prior (a third tensor)
FORMAT_V2 = "lmcache_backend.segment.v2"
#: dtype of a stored staleness prior
STALENESS_DTYPE = torch.float16
# A header holds two tensor entries and a few short strings; anything far larger is not ours.
MAX_HEADER_BYTES = 64 * 1024

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_DTYPES_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in _ST_DTYPES}


class CorruptEntryError(ValueError):
    """The bytes are not a complete, intact entry for the requested key."""


class FingerprintMismatchError(ValueError):
    """The entry is intact but was written for another model fingerprint."""


def dtype_from_name(name: str) -> torch.dtype | None:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ``None`` if unknown."""
    return _DTYPES_BY_NAME.get(str(name).strip().removeprefix("torch."))


def fingerprint_hex(fingerprint: ModelFingerprint | None, shard: str = "") -> str:
    """Hex digest stored in (and checked against) each entry; ``""`` without a fingerprint.

    ``shard`` (e.g. ``"tp1of4"``) names the part of the KV heads a tensor-parallel rank holds:
    ranks compute different K/V for the same key, so each checks for its own shard.
    """
    if fingerprint is None:
        return ""
    if not shard:
        return fingerprint.digest().hex()
    return hashlib.sha256(fingerprint.digest() + b"|shard=" + shard.encode()).hexdigest()


@dataclass(frozen=True)
class ExpectedLayout:
    """What a valid entry of this model must look like; ``None`` fields are not checked.

    Attributes:
        num_layers: ``L`` of ``[L, n, Hkv, D]``.
        num_kv_heads: ``Hkv`` (the heads this process holds, e.g. a tensor-parallel shard).
        head_dim: ``D``.
        dtype: element type of keys and values.
    """

    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def from_fingerprint(
        cls, fingerprint: ModelFingerprint, num_kv_heads: int | None = None
    ) -> ExpectedLayout:
        """Layout implied by ``fingerprint``; pass ``num_kv_heads`` when this process holds a
        shard of the KV heads."""
        return cls(
            num_layers=fingerprint.num_layers,
            num_kv_heads=fingerprint.num_kv_heads if num_kv_heads is None else num_kv_heads,
            head_dim=fingerprint.head_dim,
            dtype=dtype_from_name(fingerprint.dtype),
        )

    def mismatch(self, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """Why ``shape``/``dtype`` does not fit, or ``None`` when it does."""
        if len(shape) != 4 or shape[1] < 1:
            return f"shape {list(shape)} is not [layers, tokens>=1, kv_heads, head_dim]"
        checks = (
            ("layers", self.num_layers, shape[0]),
            ("kv_heads", self.num_kv_heads, shape[2]),
            ("head_dim", self.head_dim, shape[3]),
        )
        for name, want, got in checks:
            if want is not None and want != got:
                return f"{name} is {got}, the model has {want}"
        if self.dtype is not None and dtype != self.dtype:
            return f"dtype is {dtype}, the model uses {self.dtype}"
        return None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor without a copy (any dtype, bf16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def encode(
    key: str, kv: SegmentKV, fingerprint: str, layout: ExpectedLayout | None = None
) -> bytes:
    """Serialise ``kv`` (keys/values ``[L, n, Hkv, D]``, any device) for ``key``.

    Args:
        key: the segment key (stored and checked on decode).
        kv: the segment.
        fingerprint: hex digest from :func:`fingerprint_hex`.
        layout: when given, a segment that does not fit it is refused (``ValueError``): it
            would be rejected on every load anyway.
    """
    if kv.keys.dtype not in _ST_DTYPES or kv.values.dtype != kv.keys.dtype:
        raise ValueError(f"cannot store dtype {kv.keys.dtype}/{kv.values.dtype}")
    if layout is not None:
        why = layout.mismatch(tuple(kv.keys.shape), kv.keys.dtype)
        if why is not None:
            raise ValueError(f"segment does not fit this model: {why}")
    keys = kv.keys.detach().to("cpu").contiguous()
    values = kv.values.detach().to("cpu").contiguous()
    tensors = {"keys": keys, "values": values}
    if kv.staleness is not None:
        tensors["staleness"] = kv.staleness.detach().to("cpu", STALENESS_DTYPE).contiguous()
    digest = hashlib.blake2b(digest_size=32)
    for tensor in tensors.values():
        digest.update(_tensor_bytes(tensor))
    metadata = {
        "format": FORMAT if kv.staleness is None else FORMAT_V2,
        "key": key,
        "fingerprint": fingerprint,
        "start_position": str(int(kv.start_position)),
        "dtype": str(keys.dtype).removeprefix("torch."),
        "shape": json.dumps(list(keys.shape)),
        "checksum": "blake2b-256:" + digest.hexdigest(),
    }
    if kv.context is not None:
        metadata["context"] = kv.context
    if kv.preceding is not None:
        metadata["preceding"] = json.dumps(list(kv.preceding))
    return st_save(tensors, metadata)


def _corrupt(why: str) -> CorruptEntryError:
    return CorruptEntryError(why)


def _parse_header(data: bytes | memoryview) -> tuple[int, dict]:
    if len(data) < 8:
        raise _corrupt(f"truncated: {len(data)} bytes, no header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise _corrupt(f"header length {header_len} does not fit in {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(f"unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt("header is not a JSON object")
    return 8 + header_len, header


def _tensor_span(
    header: dict, name: str, dtype_code: str, shape: list[int], nbytes: int
) -> tuple[int, int]:
    """``(begin, end)`` of tensor ``name`` in the data, checked against its expected dtype, shape
    and size."""
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise _corrupt(f"no tensor {name!r}")
    if entry.get("dtype") != dtype_code or entry.get("shape") != shape:
        raise _corrupt(
            f"tensor {name!r} is {entry.get('dtype')} {entry.get('shape')}, "
            f"metadata says {dtype_code} {shape}"
        )
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or offsets[1] - offsets[0] != nbytes
    ):
        raise _corrupt(f"tensor {name!r} has offsets {offsets}")
    return offsets[0], offsets[1]


def decode(
    data: bytes | memoryview,
    key: str,
    fingerprint: str | None,
    layout: ExpectedLayout | None = None,
    num_tokens: int | None = None,
) -> SegmentKV:
    """Parse and verify one entry; returns CPU tensors ``[L, n, Hkv, D]``.

    Args:
        data: the stored bytes.
        key: the key it was looked up under; the entry must name the same key.
        fingerprint: expected fingerprint hex digest; ``None`` skips the check.
        layout: expected model layout; ``None`` skips the check.
        num_tokens: the segment's length ``n`` (the key is a digest of its tokens); ``None``
            skips the check.

    Raises:
        CorruptEntryError: truncated, altered, not this key, not this model's layout, or not
            the segment's length.
        FingerprintMismatchError: intact, but written for another fingerprint.
    """
    data_start, header = _parse_header(data)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, FORMAT_V2):
        raise _corrupt("not a segment entry (format tag missing)")
    names = {"keys", "values"} | ({"staleness"} if meta["format"] == FORMAT_V2 else set())
    if set(header) != {"__metadata__"} | names:
        raise _corrupt(f"unexpected tensors {sorted(set(header) - {'__metadata__'})}")
    if meta.get("key") != key:
        raise _corrupt(f"entry is for key {str(meta.get('key'))[:16]}..., not {key[:16]}...")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise FingerprintMismatchError(
            f"entry was written for model fingerprint {str(meta.get('fingerprint'))[:16]}..., "
            f"this store serves {fingerprint[:16]}..."
        )
    try:
        dtype = _DTYPES_BY_NAME[meta["dtype"]]
        shape = json.loads(meta["shape"])
        start_position = int(meta["start_position"])
        checksum = str(meta["checksum"])
        context = meta.get("context")
        preceding = None if "preceding" not in meta else json.loads(meta["preceding"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(f"bad metadata ({exc!r})") from None
    if (
        not isinstance(shape, list)
        or len(shape) != 4
        or not all(isinstance(s, int) and s >= 0 for s in shape)
    ):
        raise _corrupt(f"bad shape {shape!r}")
    if start_position < 0:
        raise _corrupt(f"negative start_position {start_position}")
    if context is not None and not isinstance(context, str):
        raise _corrupt(f"bad context {context!r}")
    if preceding is not None and (
        not isinstance(preceding, list) or not all(isinstance(p, str) for p in preceding)
    ):
        raise _corrupt(f"bad preceding {str(preceding)[:40]!r}")
    if layout is not None:
        why = layout.mismatch(tuple(shape), dtype)
        if why is not None:
            raise _corrupt(f"does not fit this model: {why}")
    if num_tokens is not None and shape[1] != num_tokens:
        raise _corrupt(f"holds {shape[1]} tokens, the segment has {num_tokens}")
    nbytes = shape[0] * shape[1] * shape[2] * shape[3] * dtype.itemsize
    code = _ST_DTYPES[dtype]
    # the tensors in their checksum order (keys, values, then the prior); safetensors lays
    # them out by dtype and name, so their places are read from the header and must tile
    # the data exactly
    spans = [_tensor_span(header, name, code, shape, nbytes) for name in ("keys", "values")]
    if "staleness" in names:
        prior_bytes = shape[0] * shape[1] * STALENESS_DTYPE.itemsize
        spans.append(
            _tensor_span(header, "staleness", _ST_DTYPES[STALENESS_DTYPE], shape[:2], prior_bytes)
        )
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise _corrupt(f"tensor data at {begin} does not follow the previous one at {end}")
        end = stop
    if data_start + end != len(data):
        raise _corrupt(f"size is {len(data)} bytes, expected {data_start + end}")
    region = memoryview(data)[data_start:]
    digest_of = hashlib.blake2b(digest_size=32)
    for begin, stop in spans:
        digest_of.update(region[begin:stop])
    digest = digest_of.hexdigest()
    if checksum != "blake2b-256:" + digest:
        raise _corrupt("checksum mismatch")
    try:
        tensors = st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own error type; any failure is corruption
        raise _corrupt(f"safetensors rejected the entry ({exc})") from None
    return SegmentKV(
        tensors["keys"],
        tensors["values"],
        start_position,
        context=context,
        preceding=None if preceding is None else tuple(preceding),
        staleness=tensors.get("staleness"),
    )
