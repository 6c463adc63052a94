"""Record what each vLLM / vllm-ascend release hands a KV connector, from the released packages.

The packages are read, never installed or imported: each release is downloaded, its Python
sources are kept in a small zip and parsed with ``ast``, and one JSON fixture per release is
written, plus ``index.json`` (``tests/fixtures/engine_contracts/README.md`` has the schema). Facts
read mechanically carry ``"source": "path::Qualname"``; the few that need reading code as a whole
come from :data:`annotations.ANNOTATIONS`, each with its source.

Modules:

- ``releases``: the releases recorded by default, the schema number, version order.
- ``fetch``: ``pip download`` (the sdist from the simple index as fallback) into the cache of
  slim source zips.
- ``sources``: a release's sources and the ``ast`` helpers (definitions, parameters, attributes,
  calls with their if-tests).
- ``symbolic``: return statements with their conditions, symbolic dims, stride orders.
- ``vllm_layout``, ``vllm_attention`` (with ``vllm_read_helpers``: reads of ``kv_cache``
  through a helper and the variables choosing them; ``vllm_composite``: backends composed of
  two others), ``vllm_kv_caches``, ``vllm_connector``, ``vllm_hooks``, ``vllm_runner``: the
  sections of a vLLM fixture (``vllm_paths``: paths several of them read); ``vllm_record`` puts
  them together.
- ``ascend``: a vllm-ascend fixture.
- ``annotations``: the facts read by hand.
- ``output``: the JSON writer and ``index.json``; ``cli``: the command line.

Run it as ``python tools/record_engine_contracts.py``. Only the standard library is needed.
"""

from .cli import main

__all__ = ["main"]
