"""``lmcache-backend hardware-check``: one command that checks CacheBlend on a CUDA GPU or an
Ascend NPU and records the result (``make gpu-check`` / ``make npu-check`` set up its
environment first; see ``docs/hardware.md``).

Steps, one module each:

1. :mod:`.device_tests`: the device tests, compiled (no interpreter), a skip counting as a failure;
2. :mod:`.kernels`: ``benchmarks/kernels.py``, the Triton kernels against the copy bandwidth;
3. :mod:`.verify_runs`: ``verify`` through vLLM with tiny bf16 models, per attention backend,
   eager and with graphs;
4. :mod:`.long_prompts` (model folder and prompts in :mod:`.llama8b`): a Llama-3.1-8B-shaped
   model with dummy weights at ~8k and ~32k tokens, TTFT and peak memory against full prefill;
5. :mod:`.vllm_step` (child :mod:`.vllm_engine`, model folders :mod:`.vllm_model`, bundle
   :mod:`.vllm_bundle`): vLLM 0.26.0's engine from a carried bundle on a machine without vLLM.

:mod:`.probe` reads the device, versions and attention backends in a child process,
:mod:`.children` runs the children, :mod:`.table` prints the table and appends it to the file,
:mod:`.command` runs the steps. ``--dry-run`` runs the plumbing of every step without a device.
"""
