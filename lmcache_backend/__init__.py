"""lmcache-backend: CacheBlend (non-prefix KV-cache reuse) for vLLM on CUDA, Ascend and CPU.

Importing this package needs only torch: vLLM, triton, torch_npu and transformers are imported
by the modules that use them, when they are used.
"""

from lmcache_backend.config import BlendConfig, ConfigError, load_config
from lmcache_backend.version import __version__

__all__ = ["BlendConfig", "ConfigError", "__version__", "load_config"]
