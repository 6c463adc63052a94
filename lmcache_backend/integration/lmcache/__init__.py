"""This package's CacheBlend inside an installed LMCache.

With LMCache installed and ``enable_blending`` set, :func:`maybe_install_from_plugin` (called by
the vLLM plugin) or an explicit :func:`install` replaces LMCache's blender builder, the
positional-encoding and attention factories of its layerwise model, and (where shipped) its
legacy ``lmcache.blend`` executor with this package's: device-agnostic ops, Ascend support and
the exact causal mask, with LMCache's storage and connector unchanged. The glue is chosen from
the installed LMCache and vLLM versions through the version matrix. See ``docs/lmcache.md``.
"""

from __future__ import annotations

from lmcache_backend.integration.lmcache.installer import (
    FORCE_EXTRA_KEY,
    IncompatibleLMCache,
    InstallResult,
    force_requested,
    install,
    installed_result,
    is_installed,
    lmcache_importable,
    maybe_install_from_plugin,
    uninstall,
)

# How the glue of each family was verified (shown by ``lmcache-backend doctor``).
VERIFIED_HOW = (
    "source contract: every LMCache symbol the glue uses was checked against the release wheel "
    "(0.3.3, 0.3.7, 0.3.12); running under LMCache needs a GPU machine with vLLM + LMCache"
)


def doctor_section() -> tuple[str, list[tuple[str, str]]]:
    """``("lmcache", [(label, value), ...])`` for ``lmcache-backend doctor``."""
    from lmcache_backend.compat.lmcache import family_for
    from lmcache_backend.integration.lmcache import installer as _install

    versions = _install._versions()
    rows: list[tuple[str, str]] = []
    if versions.lmcache is None:
        rows.append(("lmcache", "not installed"))
    else:
        rows.append(("lmcache", versions.lmcache))
    if versions.lmcache is not None:
        from lmcache_backend.compat import matrix_row

        row = matrix_row(versions.vllm, versions.lmcache)
        rows.append(("matrix row", row.describe() if row else "none (outside the version matrix)"))
        family = family_for(versions.lmcache)
        rows.append(("glue", family.name if family else "none for this release"))
    result = installed_result()
    if is_installed() and result is not None:
        forced = " (forced)" if result.forced else ""
        rows.append(("interop active", f"yes: {result.family} glue{forced}"))
    else:
        rows.append(("interop active", "no"))
    rows.append(("verified", VERIFIED_HOW))
    return "lmcache", rows


__all__ = [
    "FORCE_EXTRA_KEY",
    "IncompatibleLMCache",
    "InstallResult",
    "doctor_section",
    "force_requested",
    "install",
    "installed_result",
    "is_installed",
    "lmcache_importable",
    "maybe_install_from_plugin",
    "uninstall",
]
