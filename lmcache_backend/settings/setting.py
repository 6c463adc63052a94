"""What a setting is: :class:`Setting` (one entry of the registry), its :class:`Scope`, and the
one error every invalid value raises, :class:`ConfigError`."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lmcache_backend.logtext import shorten, shown
from lmcache_backend.settings.parsers import Parser

ENV_PREFIX = "LMCACHE_"
#: the longest value an error message shows (longer ones are cut: one bounded line)
MAX_SHOWN = 80


class ConfigError(ValueError):
    """A setting's value is invalid: one line naming the setting, where its value came from,
    the value, and what is accepted."""


class Scope(str, Enum):
    """Where a setting is read, and which object holds it.

    * ``engine``: LMCache's keys and this package's own blend keys, in
      :class:`~lmcache_backend.config.BlendConfig`: a YAML file (``LMCACHE_CONFIG_FILE``),
      ``LMCACHE_<KEY>`` variables, vLLM's ``kv_connector_extra_config``, keyword arguments.
    * ``connector``: the vLLM connector's own keys, in ``kv_connector_extra_config`` only
      (:class:`~lmcache_backend.integration.vllm.settings.ConnectorSettings`).
    * ``store``: the segment store's keys under the engine key ``extra_config``
      (:class:`~lmcache_backend.storage.settings.StoreSettings`).
    * ``request``: a request's ``kv_transfer_params`` (engine keys marked ``per_request`` are
      read there too).
    * ``environment``: a variable read from the environment only.
    """

    ENGINE = "engine"
    CONNECTOR = "connector"
    STORE = "store"
    REQUEST = "request"
    ENVIRONMENT = "environment"


@dataclass(frozen=True)
class Setting:
    """One setting, declared once.

    Attributes:
        name: its key (YAML, ``kv_connector_extra_config``, ``extra_config`` or
            ``kv_transfer_params``); for an environment-only setting, the variable.
        scope: where it is read (:class:`Scope`).
        parse: its parser (:mod:`lmcache_backend.settings.parsers`).
        default: its value when nobody sets it (copied for each use: lists and dicts are safe).
        description: one line: what it does (docs, ``lmcache-backend config``).
        details: more for the docs' tables (Markdown, may link); one paragraph.
        default_doc: the default as the docs show it, where the value is worked out at start-up
            (e.g. from vLLM's engine id); empty: the default itself.
        group: a table's section, e.g. ``blend`` or ``storage`` (the docs pick groups).
        per_request: an engine key a request may set in ``kv_transfer_params``.
        aliases: former names still read (a warning names the current one).
        secret: its value is never printed.
        hidden_keys: keys of a mapping value whose values are never printed (``extra_config``
            holds the store's secret).
        owner: who defines an environment variable: this package, or e.g. ``vLLM`` for
            variables of other projects that this package reads.
    """

    name: str
    scope: Scope
    parse: Parser
    default: Any
    description: str
    details: str = ""
    default_doc: str = ""
    group: str = ""
    per_request: bool = False
    aliases: tuple[str, ...] = ()
    secret: bool = False
    hidden_keys: tuple[str, ...] = ()
    owner: str = "lmcache_backend"

    @property
    def env(self) -> str | None:
        """The environment variable it is read from: ``LMCACHE_<NAME>`` for an engine key,
        the name itself for an environment-only setting, None for the others."""
        if self.scope is Scope.ENGINE:
            return ENV_PREFIX + self.name.upper()
        if self.scope is Scope.ENVIRONMENT:
            return self.name
        return None

    @property
    def label(self) -> str:
        """How messages name it (``extra_config.<key>`` for a store key)."""
        return f"extra_config.{self.name}" if self.scope is Scope.STORE else self.name

    def default_value(self) -> Any:
        return copy.deepcopy(self.default)

    def printable(self, value: Any) -> Any:
        """``value`` fit to print: a secret hidden, a mapping's hidden keys hidden."""
        if self.secret and value is not None:
            return "<hidden>"
        if self.hidden_keys and isinstance(value, Mapping):
            return {k: "<hidden>" if k in self.hidden_keys else v for k, v in value.items()}
        if self.hidden_keys and any(key in str(value) for key in self.hidden_keys):
            return "<hidden: holds a secret>"
        return value

    def shown(self, value: Any) -> str:
        """``value`` fit for a message: secrets hidden, at most :data:`MAX_SHOWN` characters."""
        if self.secret and isinstance(value, str):
            return f"<hidden, {len(value.encode('utf-8', 'surrogatepass'))} bytes>"
        return shown(self.printable(value), MAX_SHOWN)

    def error(self, value: Any, where: str, why: str) -> ConfigError:
        """The one-line error of an invalid ``value`` that came from ``where``."""
        why = " ".join(str(why).split()) or "invalid"
        return ConfigError(
            f"{self.label} (from {where}) = {self.shown(value)}: {shorten(why, 240)}"
        )

    def value(self, raw: Any, where: str) -> Any:
        """``raw`` parsed; :class:`ConfigError` naming this setting, ``where``, the value and
        what is accepted."""
        try:
            return self.parse(raw)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            why = str(exc) or type(exc).__name__
            if self.parse.accepts not in why and not why.startswith("expected "):
                why += f" (accepted: {self.parse.accepts})"
            raise self.error(raw, where, why) from None
