"""The strategies benchmark (``lmcache-backend bench``): each KV-reuse strategy on the
engines, its answers against full prefill's and its time to first token; and the
agreement of ratio 1.0 with vLLM's own prefill."""
