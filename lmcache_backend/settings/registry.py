"""Every setting of the package in one table, and the lookups the readers share."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any

from lmcache_backend.settings.engine_keys import ENGINE_KEYS
from lmcache_backend.settings.environment import ENVIRONMENT_VARIABLES
from lmcache_backend.settings.setting import ConfigError, Scope, Setting
from lmcache_backend.settings.store_keys import STORE_KEYS
from lmcache_backend.settings.vllm_keys import CONNECTOR_KEYS, REQUEST_ONLY_KEYS

logger = logging.getLogger(__name__)

REGISTRY: tuple[Setting, ...] = (
    ENGINE_KEYS + CONNECTOR_KEYS + STORE_KEYS + REQUEST_ONLY_KEYS + ENVIRONMENT_VARIABLES
)


def in_scope(scope: Scope) -> dict[str, Setting]:
    """The settings of ``scope`` by name, in declaration order."""
    return {s.name: s for s in REGISTRY if s.scope is scope}


ENGINE = in_scope(Scope.ENGINE)
CONNECTOR = in_scope(Scope.CONNECTOR)
STORE = in_scope(Scope.STORE)
ENVIRONMENT = in_scope(Scope.ENVIRONMENT)
#: what a request's ``kv_transfer_params`` may set: ``blend`` and the per-request engine keys
REQUEST = {
    **in_scope(Scope.REQUEST),
    **{name: s for name, s in ENGINE.items() if s.per_request},
}


def _check_unique() -> None:
    """A name means one setting within a scope, and an alias is nobody's name."""
    for scope in Scope:
        names = [s.name for s in REGISTRY if s.scope is scope]
        names += [a for s in REGISTRY if s.scope is scope for a in s.aliases]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise RuntimeError(f"settings declared twice in scope {scope.value}: {duplicates}")


_check_unique()


def closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known name most like ``name`` (a typo's intended key), or None: none is at least
    ``cutoff`` alike (:func:`difflib.get_close_matches`)."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return match[0] if match else None


def parse_given(
    settings: Mapping[str, Setting], given: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """The settings of ``given`` that are in ``settings`` (by name or alias), parsed, by name.

    Raises:
        ConfigError: a value does not parse (names the setting, ``where`` and the value).
    """
    aliases = {alias: s for s in settings.values() for alias in s.aliases}
    out: dict[str, Any] = {}
    for key, raw in given.items():
        setting = settings.get(key) or aliases.get(key)
        if setting is None:
            continue
        if key != setting.name:
            logger.warning("%s (from %s) is now called %s", key, where, setting.name)
            if setting.name in given:
                continue  # the current name wins
        out[setting.name] = setting.value(raw, where)
    return out


def with_defaults(settings: Mapping[str, Setting], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every other setting of ``settings`` at its default."""
    return {
        name: values[name] if name in values else setting.default_value()
        for name, setting in settings.items()
    }


def setting_field(setting: Setting) -> Any:
    """The dataclass field of ``setting``: it defaults to a copy of the setting's default, points
    back at it (``field.metadata["setting"]``) and is left out of the repr when it is or holds a
    secret. The settings objects' generated fields use it
    (:mod:`~lmcache_backend.settings.codegen`); typed ``Any`` so that a type checker reads each
    field's declared type and sees that it has a default."""
    return field(
        default_factory=setting.default_value,
        repr=not (setting.secret or setting.hidden_keys),
        metadata={"setting": setting},
    )


__all__ = [
    "CONNECTOR",
    "ENGINE",
    "ENVIRONMENT",
    "REGISTRY",
    "REQUEST",
    "STORE",
    "ConfigError",
    "closest",
    "in_scope",
    "parse_given",
    "setting_field",
    "with_defaults",
]
