"""Where in the vLLM package the recorders of several sections look."""

BACKENDS_DIR = "vllm/v1/attention/backends/"

WORKER_DIR = "vllm/v1/worker/"

V2_RUNNER = WORKER_DIR + "gpu/model_runner.py"

V2_ATTN = WORKER_DIR + "gpu/attn_utils.py"
