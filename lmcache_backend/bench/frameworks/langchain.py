"""LangChain's RAG prompts, built and sent by LangChain itself (``langchain-openai``).

Two shapes, both ``create_stuff_documents_chain`` over ``ChatOpenAI`` pointed at the server's
``/v1``, the documents joined by the chain's default ``"\\n\\n"`` separator:

* ``langchain-stock``: LangChain's documented RAG prompt, the documents at the end of the
  **system** message and the question alone in the human message;
* ``langchain-one-message``: the ``rlm/rag-prompt`` hub prompt, instructions, question and
  documents in **one** human message.

The time to first token is the time from ``chain.stream(...)`` to its first non-empty chunk.
"""

from __future__ import annotations

from typing import Any

from lmcache_backend.bench.frameworks.common import Answer, full_prefill_body, stream_answer

#: LangChain's documented RAG system prompt (``create_retrieval_chain``'s example).
STOCK_SYSTEM = (
    "You are an assistant for question-answering tasks. "
    "Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you "
    "don't know. Use three sentences maximum and keep the "
    "answer concise."
    "\n\n"
    "{context}"
)

#: The ``rlm/rag-prompt`` hub prompt, sent as one human message.
RAG_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't "
    "know. Use three sentences maximum and keep the answer concise.\n"
    "Question: {question} \nContext: {context} \nAnswer:"
)

SHAPES = ("langchain-stock", "langchain-one-message")


class LangChainShape:
    """One LangChain prompt shape: a blended chain and its full-prefill twin (opted out, a new
    ``cache_salt`` per request:
    :func:`~lmcache_backend.bench.frameworks.common.full_prefill_body`)."""

    def __init__(
        self, name: str, base_url: str, model: str, max_tokens: int, timeout_s: float
    ) -> None:
        from langchain_classic.chains.combine_documents import create_stuff_documents_chain
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_openai import ChatOpenAI

        if name == "langchain-stock":
            prompt = ChatPromptTemplate.from_messages(
                [("system", STOCK_SYSTEM), ("human", "{input}")]
            )
            self.question_key = "input"
        elif name == "langchain-one-message":
            prompt = ChatPromptTemplate.from_messages([("human", RAG_PROMPT)])
            self.question_key = "question"
        else:
            raise ValueError(f"unknown LangChain shape {name!r}: one of {SHAPES}")
        self.name = name

        def chain(extra_body: dict[str, Any] | None) -> tuple[Any, Any]:
            llm = ChatOpenAI(
                model=model,
                base_url=f"{base_url}/v1",
                api_key="unused",
                max_tokens=max_tokens,
                temperature=0,
                timeout=timeout_s,
                max_retries=0,
                extra_body=extra_body,
            )
            return llm, create_stuff_documents_chain(llm, prompt)

        self._llms, self._chains = {}, {}
        for blend in (True, False):
            self._llms[blend], self._chains[blend] = chain(None if blend else full_prefill_body())

    def ask(self, docs: list[str], question: str, blend: bool = True) -> Answer:
        from langchain_core.documents import Document

        inputs = {
            "context": [Document(page_content=d) for d in docs],
            self.question_key: question,
        }
        if not blend:  # the chain holds this model: its next request carries a new salt
            self._llms[False].extra_body = full_prefill_body()
        return stream_answer(lambda: self._chains[blend].stream(inputs))


def make_shape(
    name: str, base_url: str, model: str, max_tokens: int, context_window: int, timeout_s: float
) -> LangChainShape:
    return LangChainShape(name, base_url, model, max_tokens, timeout_s)
