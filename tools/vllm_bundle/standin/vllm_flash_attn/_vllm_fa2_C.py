"""STAND-IN for vLLM's compiled FlashAttention-2 extension ``vllm.vllm_flash_attn._vllm_fa2_C``
(300 MB in vLLM's CUDA wheel), written for lmcache-backend's hardware check.

It registers nothing. vLLM 0.26's ``vllm/vllm_flash_attn/__init__.py`` raises ``ImportError``
unless FA2 or FA3 imports, and ``v1/attention/backends/fa_utils.py`` imports that package on
every CUDA start, whichever attention backend is selected. The check selects ``TRITON_ATTN``;
should anything call FlashAttention all the same, it fails naming the missing op
(``torch.ops._vllm_fa2_C.varlen_fwd``).
"""

STAND_IN = True
