"""``lmcache-backend serve``: ``vllm serve`` with the connector, the checks before vLLM
starts, and the server as a child process that HTTP clients drive (the demo, the
benchmarks, the tests)."""
