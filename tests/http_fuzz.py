"""Random and malformed requests for the OpenAI server, as ``hypothesis`` strategies.

A :class:`Case` is one HTTP request (chat or completions) with what the server must answer:
``"ok"`` (200 with a well-formed answer), ``"4xx"`` (a client error with a message) or
``"either"``; a 5xx, a malformed 200 or a dead server is always a failure
(:func:`check_answer`). The cases cover: random ``kv_transfer_params`` (any JSON value, the
connector's keys with random values, misspelt keys), the separator in odd places (doubled,
at the ends, alone, half of it), empty and huge documents, lone UTF-16 surrogates and bytes that
are not UTF-8, token-id prompts outside the vocabulary, and random ``cache_salt`` values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from lmcache_backend.settings import REQUEST

SEPARATOR = " # # "
#: vLLM's own check of a salt (vllm/entrypoints/generate/base/protocol.py: validate_cache_salt)
SALT_FORBIDDEN = set("@/\\\0")
SALT_MAX = 128
REQUEST_KEYS = list(REQUEST)  # what kv_transfer_params may set (the settings registry)
#: a salt the test replaces with one no request used before
FRESH = "FRESH"


@dataclass
class Case:
    """One request: ``endpoint`` (``"chat"`` or ``"completions"``), its JSON ``body`` (or raw
    ``data`` bytes), and what must come back."""

    endpoint: str
    body: dict[str, Any] | None
    expect: str = "either"
    data: bytes | None = None
    labels: list[str] = field(default_factory=list)

    def payload(self) -> bytes:
        """The request's bytes: JSON with ASCII escapes, so that a lone surrogate reaches the
        server as ``\\ud800`` (valid JSON text, an invalid Unicode string)."""
        if self.data is not None:
            return self.data
        return json.dumps(self.body, ensure_ascii=True).encode("ascii")

    @property
    def salt(self) -> Any:
        return None if self.body is None else self.body.get("cache_salt")


def salt_is_valid(salt: Any) -> bool:
    """Whether vLLM accepts ``salt`` (None: no salt)."""
    if salt is None:
        return True
    return (
        isinstance(salt, str)
        and 0 < len(salt) <= SALT_MAX
        and not any(c in SALT_FORBIDDEN for c in salt)
    )


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
kv_params = (
    st.none()  # about half the requests carry none: most answers come from the blend path
    | st.none()
    | st.none()
    | json_values
    | st.dictionaries(
        st.sampled_from([*REQUEST_KEYS, "blend_ratio", "blendx", "other_connector", ""]),
        json_values
        | st.sampled_from([True, False, [0.1], [1.0], [0.0], [1], [0, 1], [99], "query_preview"]),
        max_size=4,
    )
)


def text_pieces(docs: list[str]) -> st.SearchStrategy[str]:
    """Text built from the separator (whole, halved, doubled), the documents, whitespace,
    lone surrogates and other odd characters."""
    pieces = [SEPARATOR, "#", "# #", " # ", "##", SEPARATOR * 2, "\n", " ", "", *docs]
    odd = ["\ud800", "\udfff", "\x00", "\ufffd", "é", "\U0001f642", "\u202e"]
    piece = st.sampled_from(pieces) | st.sampled_from(odd) | st.text(max_size=12)
    return st.lists(piece, max_size=10).map("".join)


def salts() -> st.SearchStrategy[Any]:
    return (
        st.none()
        | st.none()
        | st.sampled_from([FRESH, "fuzz-tenant-1", "fuzz-tenant-2"])
        | st.sampled_from([FRESH, "fuzz-tenant-1", "fuzz-tenant-2", "", "a/b", "x@y", "\0"])
        | st.just("s" * 129)
        | st.sampled_from(["tenant-\ud800", "\udfff", "\U0001f642", "x" * 128])
        | st.text(max_size=20)
        | st.integers(0, 5)
    )


@st.composite
def chat_cases(draw, docs: list[str], model: str) -> Case:
    """A chat request: documents from ``docs`` (or empty, huge or odd ones), random params."""
    pool = st.sampled_from(docs) | st.just("") | text_pieces(docs)
    chosen = draw(st.lists(pool, max_size=4))
    labels = []
    if draw(st.integers(0, 19)) == 0:
        chosen.append("lorem ipsum " * 6000)  # far beyond the model length: a 4xx
        labels.append("huge")
    question = draw(text_pieces(docs) | st.just("Which names appear?"))
    content = "".join(SEPARATOR + d for d in chosen) + SEPARATOR + question
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 2,
        "temperature": 0,
    }
    params = draw(kv_params)
    if params is not None:
        body["kv_transfer_params"] = params
    salt = draw(salts())
    if salt is not None:
        body["cache_salt"] = salt
    expect = "either"
    if not salt_is_valid(salt) or "huge" in labels:
        expect = "4xx"
    if "" in chosen:
        labels.append("empty doc")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in content):
        labels.append("surrogate")
    return Case("chat", body, expect, labels=labels)


def _outside_vllm_integers(value: Any) -> bool:
    """Whether a JSON value holds an integer vLLM refuses in ``kv_transfer_params`` (its
    ``extra_args`` take integers from -2**63 to 2**64 - 1 only: a 400 before any connector)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -(2**63) <= value <= 2**64 - 1
    if isinstance(value, dict):
        return any(_outside_vllm_integers(v) for v in value.values())
    if isinstance(value, list):
        return any(_outside_vllm_integers(v) for v in value)
    return False


@st.composite
def token_cases(draw, vocab_size: int, model: str) -> Case:
    """A completions request whose prompt is token ids, some perhaps outside the vocabulary."""
    inside = st.integers(0, vocab_size - 1)
    outside = st.integers(vocab_size, vocab_size + 10) | st.integers(-3, -1)
    outside |= st.sampled_from([2**31, 2**63 - 1, -(2**63)])
    ids = draw(st.lists(inside, max_size=48) | st.lists(inside | outside, min_size=1, max_size=48))
    body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0}
    params = draw(kv_params)
    if params is not None:
        body["kv_transfer_params"] = params
    valid = bool(ids) and all(0 <= i < vocab_size for i in ids)
    labels = ["token ids" if valid else "token ids outside the vocabulary"]
    if params is not None and not isinstance(params, dict):  # vLLM wants an object: 400
        return Case("completions", body, "4xx", labels=labels)
    if _outside_vllm_integers(params):
        return Case("completions", body, "4xx", labels=[*labels, "integer out of vLLM's range"])
    return Case("completions", body, "ok" if valid else "4xx", labels=labels)


@st.composite
def raw_cases(draw, model: str) -> Case:
    """Bytes that are not UTF-8 inside a JSON string, or not JSON at all."""
    junk = draw(st.binary(min_size=1, max_size=16).filter(lambda b: not _is_utf8(b)))
    prefix = json.dumps({"model": model, "prompt": "x", "max_tokens": 1})[:-1].encode()
    data = draw(
        st.sampled_from(
            [
                prefix + b', "kv_transfer_params": {"blend": "' + junk + b'"}}',
                prefix + b', "cache_salt": "' + junk + b'"}',
                b'{"model": "' + junk + b'", "prompt": "hi"}',
                junk,
            ]
        )
    )
    return Case("completions", None, "4xx", data=data, labels=["not UTF-8"])


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def check_answer(case: Case, status: int, body: Any) -> None:
    """Raise AssertionError unless ``status``/``body`` are what ``case`` must get."""
    what = f"{case.endpoint} {case.labels} -> {status}: {str(body)[:300]}"
    assert status < 500, f"server error: {what}"
    if case.expect == "ok":
        assert status == 200, what
    if case.expect == "4xx":
        assert 400 <= status < 500, what
    if status == 200:
        assert isinstance(body, dict) and body.get("choices"), what
        choice = body["choices"][0]
        text = choice["message"]["content"] if case.endpoint == "chat" else choice["text"]
        assert isinstance(text, str) or text is None, what
        assert body["usage"]["prompt_tokens"] > 0, what
        if case.endpoint == "completions" and isinstance(case.body.get("prompt"), list):
            assert body["usage"]["prompt_tokens"] == len(case.body["prompt"]), what
    else:
        # vLLM's errors: {"error": {...}}; the HTTP layer's (a body it cannot parse): "detail"
        assert isinstance(body, dict), what
        assert body.get("error") or body.get("message") or body.get("detail"), what
