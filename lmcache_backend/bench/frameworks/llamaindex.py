"""LlamaIndex's RAG prompts, built and sent by LlamaIndex itself (``llama-index-llms-openai-like``).

Both shapes are LlamaIndex's default response synthesizer, ``CompactAndRefine(streaming=True)``,
over the given text chunks (``get_response(question, chunks)``), with ``OpenAILike`` pointed at
the server's ``/v1``. The chunks are packed into one context (joined by ``"\\n\\n"``; the context
window is the server's, so they fit in one call) and put into LlamaIndex's default text QA
template:

* ``llamaindex-completions``: ``is_chat_model=False``, the template as a ``/v1/completions``
  prompt;
* ``llamaindex-chat``: ``is_chat_model=True``, LlamaIndex's chat QA template: its own system
  message, then documents and question in one user message.

The time to first token is the time from ``get_response`` to the first non-empty text of the
streaming response generator.
"""

from __future__ import annotations

from typing import Any

from lmcache_backend.bench.frameworks.common import Answer, full_prefill_body, stream_answer

SHAPES = ("llamaindex-completions", "llamaindex-chat")


class LlamaIndexShape:
    """One LlamaIndex prompt shape: a blended synthesizer and its full-prefill twin (opted out,
    a new ``cache_salt`` per request:
    :func:`~lmcache_backend.bench.frameworks.common.full_prefill_body`)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        model: str,
        max_tokens: int,
        context_window: int,
        timeout_s: float,
    ) -> None:
        from llama_index.core.response_synthesizers import CompactAndRefine
        from llama_index.llms.openai_like import OpenAILike

        if name not in SHAPES:
            raise ValueError(f"unknown LlamaIndex shape {name!r}: one of {SHAPES}")
        self.name = name

        def synthesizer(extra_body: dict[str, Any] | None) -> tuple[Any, Any]:
            llm = OpenAILike(
                model=model,
                api_base=f"{base_url}/v1",
                api_key="unused",
                is_chat_model=name == "llamaindex-chat",
                context_window=context_window,
                max_tokens=max_tokens,
                temperature=0,
                timeout=timeout_s,
                max_retries=0,
                additional_kwargs={"extra_body": extra_body} if extra_body else {},
            )
            return llm, CompactAndRefine(llm=llm, streaming=True)

        self._llms, self._synth = {}, {}
        for blend in (True, False):
            body = None if blend else full_prefill_body()
            self._llms[blend], self._synth[blend] = synthesizer(body)

    def ask(self, docs: list[str], question: str, blend: bool = True) -> Answer:
        if not blend:  # the synthesizer holds this model: its next request carries a new salt
            self._llms[False].additional_kwargs = {"extra_body": full_prefill_body()}

        def tokens() -> Any:
            response = self._synth[blend].get_response(question, list(docs))
            return [response] if isinstance(response, str) else response

        return stream_answer(tokens)


def make_shape(
    name: str, base_url: str, model: str, max_tokens: int, context_window: int, timeout_s: float
) -> LlamaIndexShape:
    return LlamaIndexShape(name, base_url, model, max_tokens, context_window, timeout_s)
