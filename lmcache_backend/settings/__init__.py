"""The settings registry: every setting of the package, declared once.

Each :class:`~lmcache_backend.settings.setting.Setting` says its name, its
:class:`~lmcache_backend.settings.setting.Scope` (engine, connector, store, request or
environment-only), its parser (one per type: :mod:`~lmcache_backend.settings.parsers`, which
also says what it accepts), its default, a one-line description and where it is read (the
``LMCACHE_<KEY>`` variable of an engine key, the ``kv_connector_extra_config`` /
``extra_config`` / ``kv_transfer_params`` name). Everything else follows from the entry:

* the objects that hold the values are built from it: :class:`~lmcache_backend.config.
  BlendConfig` (engine), :class:`~lmcache_backend.integration.vllm.settings.ConnectorSettings`
  (connector), :class:`~lmcache_backend.storage.settings.StoreSettings` (store); a request's
  ``kv_transfer_params`` are read by
  :func:`~lmcache_backend.integration.vllm.settings.request_config`;
* parsing and the error for a bad value (one line: the key, where the value came from, the value
  and what is accepted), the warning for an unknown key (naming the closest declared one);
* the tables in the README and the docs (``lmcache-backend config --docs`` rewrites them between
  ``<!-- settings-table: ... -->`` markers; a test fails when they drift);
* the typed fields of those objects (:mod:`~lmcache_backend.settings.codegen`: an editor and a
  type checker see each field's type; ``lmcache-backend config --docs`` writes them too);
* environment variables: :func:`~lmcache_backend.settings.environment.read_variable` is the only
  reader of ``os.environ`` for a setting, :mod:`~lmcache_backend.settings.writer` the only writer
  (``child_env``, ``export``: typed values in, text its parser reads back out);
* command-line flags that take a setting's values parse them with its parser
  (:func:`~lmcache_backend.settings.arguments.setting_type`).

Adding a setting
----------------
1. Add one entry to the module of its scope: ``engine_keys.py`` (a key of
   ``BlendConfig``: YAML, ``LMCACHE_<KEY>``, ``kv_connector_extra_config``; ``per_request=True``
   lets a request set it too), ``vllm_keys.py`` (a connector key, or a request-only key),
   ``store_keys.py`` (an ``extra_config`` key of the store) or ``environment.py`` (a variable
   read from the environment only). Pick a parser from :mod:`.parsers` (a range or choices
   belong in the parser, so the error and the docs say them), a default, a one-line
   ``description`` (and ``details`` for the docs where a line is not enough).
2. Write the code that acts on it, reading ``config.<name>`` / ``settings.<name>`` /
   ``store.<name>`` (or ``read_variable("<NAME>")``). A rule between several keys (e.g. one
   ratio per check layer) goes into the object's own check (``BlendConfig._check_together``).
3. Run ``lmcache-backend config --docs`` to regenerate the tables and the typed fields (a test
   fails while either differs from the registry).

The fuzz test (``tests/test_config_fuzz.py``) draws keys from the registry: a new key is fuzzed
without touching it.
"""

from __future__ import annotations

from lmcache_backend.settings.engine_keys import (
    BACKEND_CHOICES,
    LMCACHE_KEYS_IGNORED,
    PREVIEW_SELECTION_CHOICES,
    SCORED_LAYER_CHOICES,
    SEGMENTATION_CHOICES,
    SELECTION_CHOICES,
)
from lmcache_backend.settings.environment import CONFIG_FILE_ENV, read_variable
from lmcache_backend.settings.registry import (
    CONNECTOR,
    ENGINE,
    ENVIRONMENT,
    REGISTRY,
    REQUEST,
    STORE,
    closest,
    parse_given,
    setting_field,
    with_defaults,
)
from lmcache_backend.settings.setting import ENV_PREFIX, ConfigError, Scope, Setting

__all__ = [
    "BACKEND_CHOICES",
    "CONFIG_FILE_ENV",
    "CONNECTOR",
    "ENGINE",
    "ENVIRONMENT",
    "ENV_PREFIX",
    "LMCACHE_KEYS_IGNORED",
    "PREVIEW_SELECTION_CHOICES",
    "REGISTRY",
    "REQUEST",
    "SCORED_LAYER_CHOICES",
    "SEGMENTATION_CHOICES",
    "SELECTION_CHOICES",
    "STORE",
    "ConfigError",
    "Scope",
    "Setting",
    "closest",
    "parse_given",
    "read_variable",
    "setting_field",
    "with_defaults",
]
