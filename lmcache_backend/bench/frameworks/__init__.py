"""``lmcache-backend bench --client``: LangChain and LlamaIndex build and send their own
RAG prompts to the server."""
