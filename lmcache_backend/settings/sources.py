"""Where engine keys come from, later sources overriding earlier ones:

1. their defaults (the registry);
2. a YAML file named by ``LMCACHE_CONFIG_FILE`` (or the ``config_file`` argument);
3. ``LMCACHE_<KEY>`` environment variables;
4. keyword arguments (e.g. vLLM's ``kv_connector_extra_config``).

:func:`engine_values` reads them all, parsed, with where each came from; a key nobody declared
is logged with the closest declared one (LMCache's own keys that this package does not use
load quietly, and so do the package's documented environment variables).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lmcache_backend.settings.engine_keys import LMCACHE_KEYS_IGNORED
from lmcache_backend.settings.environment import CONFIG_FILE_ENV, environment
from lmcache_backend.settings.registry import CONNECTOR, ENGINE, ENVIRONMENT, closest
from lmcache_backend.settings.setting import ENV_PREFIX, ConfigError

#: the warnings keep the logger name of the loader users know (``lmcache_backend.config``)
logger = logging.getLogger("lmcache_backend.config")

ARGUMENT = "argument"
#: the connector's keys (and former names): read from the same keyword arguments by the connector
_CONNECTOR_NAMES = frozenset(CONNECTOR) | {a for s in CONNECTOR.values() for a in s.aliases}


def warn_unknown(key: str, where: str) -> None:
    """Log that the engine key ``key`` (from ``where``) is ignored, naming the closest declared
    one (the variable too, for a key that came from one)."""
    if key in LMCACHE_KEYS_IGNORED:
        logger.debug("LMCache setting %s (from %s) is not used by lmcache_backend", key, where)
        return
    if key in _CONNECTOR_NAMES:
        logger.warning(
            "configuration key %r (from %s) ignored: the connector reads it from vLLM's "
            "kv_connector_extra_config only",
            key,
            where,
        )
        return
    if where.startswith(ENV_PREFIX):
        # the package's own variables are declared: a typo of one is named as a variable
        engine = {s.env: f"{name!r} ({s.env})" for name, s in ENGINE.items() if s.env}
        own = {v: v for v in ENVIRONMENT if v.startswith(ENV_PREFIX)}
        close = closest(where, {**engine, **own})
        hint = {**engine, **own}.get(close) if close else None
    else:
        close = closest(key, [*ENGINE, *(CONNECTOR if where == ARGUMENT else ())])
        hint = repr(close) if close else None
    suffix = f"; did you mean {hint}?" if hint else ""
    logger.warning("unknown configuration key %r (from %s) ignored%s", key, where, suffix)


def read_yaml(path: str) -> dict:
    """The mapping in the YAML file ``path``; :class:`ConfigError` naming the file if not."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{CONFIG_FILE_ENV}: file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}: cannot read {path!r}: {exc}") from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path!r} is not valid YAML: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path!r} must hold a mapping of keys to values")
    return data


def _engine_variables(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """``(key, raw value, variable)`` of every ``LMCACHE_*`` variable but the environment-only
    ones (declared: never "unknown")."""
    return [
        (name[len(ENV_PREFIX) :].lower(), raw, name)
        for name, raw in env.items()
        if name.startswith(ENV_PREFIX) and name not in ENVIRONMENT
    ]


def engine_values(
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The engine keys set by the sources (module docstring), parsed: ``(values, sources)``,
    ``sources`` naming where each value came from (a file, a variable, ``"argument"``).
    ``None`` overrides are skipped (vLLM passes unset extra-config keys that way).

    Raises:
        ConfigError: a value does not parse, or the YAML file cannot be read.
    """
    env = environment() if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(key: str, raw: Any, where: str) -> None:
        setting = ENGINE.get(key)
        if setting is None:
            if where == ARGUMENT and key in _CONNECTOR_NAMES:
                return  # the connector reads its own keys from the same mapping
            warn_unknown(key, where)
            return
        values[key] = setting.value(raw, where)
        sources[key] = where

    path = config_file or env.get(CONFIG_FILE_ENV)
    if path:
        for key, raw in read_yaml(path).items():
            take(str(key), raw, path)
    for key, raw, variable in _engine_variables(env):
        take(key, raw, variable)
    for key, raw in (overrides or {}).items():
        if raw is not None:
            take(key, raw, ARGUMENT)
    return values, sources


def configured(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of the engine key ``name`` from the YAML file and the environment alone
    (its default when neither sets it), without warnings about other keys: for code that
    needs one key where no configuration is handed down (the legacy LMCache executor's
    ``backend``)."""
    env = environment() if env is None else env
    setting = ENGINE[name]
    value = setting.default_value()
    path = env.get(CONFIG_FILE_ENV)
    if path:
        data = read_yaml(path)
        if name in data:
            value = setting.value(data[name], path)
    variable = setting.env
    if variable is not None and variable in env:
        value = setting.value(env[variable], variable)
    return value
