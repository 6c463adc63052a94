"""Installing the glue into a running LMCache: version choice, refusals, idempotence, undo.

Nothing here names an LMCache symbol: the glue (:mod:`.glue`) says what to replace, this module
imports the declared modules, swaps the bindings and remembers the originals.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any

from lmcache_backend.compat import (
    MatrixRow,
    UnsupportedVersions,
    Versions,
    check_supported,
    detect_versions,
)
from lmcache_backend.compat.lmcache import family_for
from lmcache_backend.config import ConfigError, load_config
from lmcache_backend.integration.lmcache.glue import FORCE_ENV, Glue, glue_for
from lmcache_backend.settings import ENVIRONMENT, read_variable
from lmcache_backend.settings.environment import FORCE_LMCACHE_EXTRA_KEY

logger = logging.getLogger(__name__)

# ``extra_config`` key (LMCache's ``LMCACHE_EXTRA_CONFIG`` JSON, or the YAML file) that allows an
# LMCache release outside the version matrix, like ``LMCACHE_BACKEND_FORCE_LMCACHE=1``.
FORCE_EXTRA_KEY = FORCE_LMCACHE_EXTRA_KEY


class IncompatibleLMCache(RuntimeError):
    """The installed LMCache lacks a symbol the glue needs; the message names it."""


@dataclass(frozen=True)
class InstallResult:
    """What :func:`install` did.

    Attributes:
        installed: the glue is in place after the call.
        already: it was in place before the call (nothing changed).
        family: the glue's LMCache family (``"0.3.3"``, ``"0.3.7"``, ``"0.3.12"``) or None.
        lmcache, vllm: the versions found.
        row: the matrix row, or None (forced outside the matrix, or nothing installed).
        forced: an unlisted combination was allowed by force.
        patched: ``module:qualname`` of every replaced binding.
        reason: why nothing was installed, or "".
    """

    installed: bool
    already: bool = False
    family: str | None = None
    lmcache: str | None = None
    vllm: str | None = None
    row: MatrixRow | None = None
    forced: bool = False
    patched: tuple[str, ...] = ()
    reason: str = ""


@dataclass
class _Patch:
    owner: Any
    attr: str
    original: Any
    replacement: Any
    label: str

    def in_place(self) -> bool:
        return vars(self.owner).get(self.attr) is self.replacement


@dataclass
class _Installed:
    glue: Glue
    result: InstallResult
    patches: list[_Patch] = field(default_factory=list)


_state: _Installed | None = None


def _versions() -> Versions:
    """Installed versions (a seam for tests)."""
    return detect_versions()


def lmcache_importable() -> bool:
    """Whether ``import lmcache`` would find a package (without importing it)."""
    try:
        return importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        return False


def is_installed() -> bool:
    """Whether the glue is installed and every replaced binding is still ours."""
    return _state is not None and all(p.in_place() for p in _state.patches)


def installed_result() -> InstallResult | None:
    return _state.result if _state is not None else None


def install(force: bool = False) -> InstallResult:
    """Install this package's CacheBlend into the installed LMCache (idempotent).

    Args:
        force: allow an LMCache / vLLM combination the version matrix does not list (the glue
            of the family whose release range holds the LMCache version is used, and its
            symbols are still checked). Rows marked unsupported or conflicting are refused
            even then.

    Raises:
        UnsupportedVersions: LMCache is missing, or the combination is refused (the message
            gives the matrix row and what to install).
        IncompatibleLMCache: a symbol the glue replaces is missing from the installed LMCache.
    """
    global _state
    versions = _versions()
    if versions.lmcache is None:
        raise UnsupportedVersions("LMCache is not installed: pip install lmcache (see the matrix)")
    row = check_supported(versions.vllm, versions.lmcache, force)
    family = family_for(versions.lmcache, forced=row is None)
    if family is None:
        raise UnsupportedVersions(
            f"LMCache {versions.lmcache}: no glue covers this release (families: 0.3.3, 0.3.7, "
            "0.3.12); install a release from the version matrix"
        )
    if _state is not None:
        if _state.glue.family is family and is_installed():
            return _with(_state.result, already=True)
        uninstall()
    glue = glue_for(family)
    patches = _plan(glue)
    for patch in patches:
        setattr(patch.owner, patch.attr, patch.replacement)
    result = InstallResult(
        installed=True,
        family=family.name,
        lmcache=versions.lmcache,
        vllm=versions.vllm,
        row=row,
        forced=row is None,
        patched=tuple(p.label for p in patches),
    )
    _state = _Installed(glue, result, patches)
    how = row.describe() if row else "forced outside the version matrix"
    logger.info("lmcache_backend CacheBlend installed into LMCache (%s glue; %s)", family.name, how)
    return result


def _plan(glue: Glue) -> list[_Patch]:
    """Resolve every binding to replace before changing any, so a miss changes nothing."""
    ops_name = load_config().backend
    replacements = glue.replacements(ops_name)
    patches, missing = [], []
    for sym in glue.family.replaced:
        try:
            owner = glue.owner_of(sym.key)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{sym.describe()}: {exc}")
            continue
        if sym.attr not in vars(owner):
            missing.append(f"{sym.describe()}: not defined")
            continue
        patches.append(
            _Patch(
                owner=owner,
                attr=sym.attr,
                original=vars(owner)[sym.attr],
                replacement=replacements[sym.key],
                label=f"{sym.module}:{sym.qualname}",
            )
        )
    if missing:
        raise IncompatibleLMCache(
            f"the installed LMCache does not match the {glue.family.name} glue: "
            + "; ".join(missing)
        )
    return patches


def uninstall() -> bool:
    """Restore LMCache's originals and drop the blenders this package created.

    Returns whether anything was installed.
    """
    global _state
    if _state is None:
        return False
    state, _state = _state, None
    for patch in reversed(state.patches):
        setattr(patch.owner, patch.attr, patch.original)
    try:
        state.glue.forget_blenders()
    except (ImportError, AttributeError):  # LMCache went away under us: nothing to forget
        pass
    logger.info("lmcache_backend CacheBlend removed from LMCache")
    return True


def force_requested() -> bool:
    """``LMCACHE_BACKEND_FORCE_LMCACHE`` or the ``extra_config`` key asks to force."""
    try:
        if read_variable(FORCE_ENV):
            return True
        value = load_config().extra_config.get(FORCE_EXTRA_KEY, False)
        return bool(ENVIRONMENT[FORCE_ENV].value(value, f"extra_config[{FORCE_EXTRA_KEY!r}]"))
    except ConfigError as exc:
        raise UnsupportedVersions(str(exc)) from None


def maybe_install_from_plugin() -> InstallResult:
    """What the vLLM plugin calls at start-up.

    Installs only when LMCache is importable and ``enable_blending`` is set; otherwise returns a
    result saying why not. A refused or unlisted combination raises (unless forced), so a
    misconfigured deployment stops at start-up instead of blending wrongly.
    """
    if not lmcache_importable():
        return InstallResult(installed=False, reason="LMCache is not installed")
    if not load_config().enable_blending:
        return InstallResult(installed=False, reason="enable_blending is off")
    return install(force=force_requested())


def _with(result: InstallResult, **changes: Any) -> InstallResult:
    values = {name: getattr(result, name) for name in result.__dataclass_fields__}
    values.update(changes)
    return InstallResult(**values)
