"""``lmcache-backend bench``: KV-reuse strategies side by side on RAG prompts.

For every example the store is filled from the prompt with its chunks in their original order,
then the prompt with the chunks reordered is answered by each strategy: full prefill (the quality
reference), prefix caching, naive full reuse, CacheBlend at several ratios and an EPIC-style
static selection. See ``docs/benchmarks.md`` for how to read the numbers.
"""

from __future__ import annotations

from lmcache_backend.bench.arguments import add_arguments
from lmcache_backend.bench.cli import main

__all__ = ["add_arguments", "main"]
