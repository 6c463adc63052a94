"""The benchmarks' examples: the built-in set, the dev sets, MuSiQue, long-context
variants and JSONL files."""
