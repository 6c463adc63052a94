"""The connector's scheduler side (vLLM's engine-core process): which prompts to claim,
one record per request, and the plan each step hands the workers."""
