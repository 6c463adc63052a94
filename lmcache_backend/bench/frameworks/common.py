"""What the framework clients share: a streamed answer, the opt-out, the connector's stats file."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The ``kv_transfer_params`` of a full prefill on a CacheBlend server: no reuse, and nothing
#: stored (LMCache's ``lmcache.skip_save``): under a salt of its own nobody could find its K/V,
#: and writing them would cost the server what a server without CacheBlend never pays.
FULL_PREFILL_PARAMS: dict[str, Any] = {"blend": False, "lmcache.skip_save": True}

#: The request body field that opts a request out of reuse (a full prefill on the same server).
OPT_OUT: dict[str, Any] = {"kv_transfer_params": FULL_PREFILL_PARAMS}

#: How the benchmarks keep a full prefill full, in their output.
FULL_PREFILL_NOTE = (
    "full prefill: each request opted out of reuse and of the store (lmcache.skip_save) and "
    "given a cache_salt of its own, so neither vLLM's prefix cache nor the connector's store "
    "serves any of its tokens, whether the server runs with prefix caching or not"
)


def full_prefill_body() -> dict[str, Any]:
    """The body fields of one full-prefill request: opted out of reuse, with a ``cache_salt``
    never used before. vLLM's prefix cache serves a request only blocks computed under the same
    salt (and the store keeps salts apart), so the request computes every token even when the
    same prompt ran just before; without the salt a full prefill sent after its blended twin
    would be served from the prefix cache, and the TTFT ratio would mean nothing."""
    return {**OPT_OUT, "cache_salt": f"full-prefill-{uuid.uuid4().hex}"}


@dataclass
class Answer:
    """One streamed answer: its text, the time to its first non-empty chunk and to its end."""

    text: str
    ttft_s: float
    total_s: float


def stream_answer(start: Callable[[], Iterable[Any]]) -> Answer:
    """Call ``start()`` (it sends the request through the framework) and read its stream of text
    chunks; the clock starts before the call."""
    began = time.perf_counter()
    first = None
    parts: list[str] = []
    for chunk in start():
        text = chunk if isinstance(chunk, str) else str(getattr(chunk, "content", chunk) or "")
        if text:
            if first is None:
                first = time.perf_counter() - began
            parts.append(text)
    total = time.perf_counter() - began
    return Answer("".join(parts), total if first is None else first, total)


@dataclass
class Reuse:
    """What the connector's stats file says about one request.

    ``seen``: the connector wrote a line for it. ``blended``: that line is a blend (a line
    without a ``blended`` field is one, unless it fell back to a full prefill); ``reason``: why
    not, when the line says. ``share``: reused tokens over prompt tokens (0 when not blended).
    """

    seen: bool
    blended: bool
    reason: str | None = None
    num_tokens: int = 0
    num_reusable: int = 0
    token_layer_fraction: float | None = None
    req_id: str | None = None

    @property
    def share(self) -> float:
        return self.num_reusable / self.num_tokens if self.blended and self.num_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "share": self.share}


NOT_SEEN = Reuse(seen=False, blended=False, reason="no stats line")


def reuse_of(records: list[dict[str, Any]]) -> Reuse:
    """The reuse of the request that wrote ``records`` (its lines; the last one counts)."""
    if not records:
        return NOT_SEEN
    rec = records[-1]
    reason = rec.get("reason") if rec.get("blended", True) is False else rec.get("fallback_reason")
    return Reuse(
        seen=True,
        blended=rec.get("blended", True) is not False and not rec.get("fallback_reason"),
        reason=reason,
        num_tokens=int(rec.get("num_tokens") or 0),
        num_reusable=int(rec.get("num_reusable") or 0),
        token_layer_fraction=rec.get("token_layer_fraction"),
        req_id=rec.get("req_id"),
    )


class StatsFile:
    """The server's ``stats_file`` (JSON lines); a request's lines are those that appear while
    it runs (requests are sent one at a time). Without a file every request reads as not seen."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None

    def lines(self) -> list[dict[str, Any]]:
        if self.path is None or not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line being written right now
                    break
        return out

    def around(self, send: Callable[[], Answer]) -> tuple[Answer, Reuse]:
        """Send one request; its answer and what the stats file says about it."""
        before = len(self.lines())
        answer = send()
        if self.path is None:
            return answer, Reuse(seen=False, blended=False, reason="no stats file")
        return answer, reuse_of(self.lines()[before:])
