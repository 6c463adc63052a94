"""The version gate: whether CacheBlend runs on the installed vLLM, and with which code path.

:func:`decide` is the whole policy, a pure function of the installed versions, the platform and
``allow_untested_versions``; every outcome is one line naming what to install when it refuses:

* a release inside a code path's range runs it (``stable`` where an engine ran it on that
  platform, else what was checked without one: its source contract and the CPU-tensor path);
* a recorded release no code path serves (vLLM 0.9.1), a platform without support (ROCm, XPU)
  and a code path without a CPU backend on CPU are refused, whatever the setting;
* a release between two ranges (0.10.1, 0.11.1) has no record: it runs the code path whose
  symbols its installed source has (feature probing, :mod:`lmcache_backend.compat.probe`),
  else it is refused;
* a release older or newer than every range, an unknown vllm-ascend release, or vllm-ascend with
  another vLLM than it pins are refused unless ``allow_untested_versions`` is set, which runs the
  nearest code path and says so.

The setting is read in one place: the connector passes its ``allow_untested_versions`` to
:func:`admit` when it starts, before anything else of the integration asks for a profile. The
model adapter then reads :func:`current_profile` (what was admitted, never re-deciding), and the
plugin, which runs before any connector exists, reads :func:`code_path` (never refuses: it only
records the loaded model, and the connector refuses afterwards with the message).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_backend.compat import MatrixRow, matrix_row
from lmcache_backend.compat.ascend import ascend_release, nearest_ascend, supported_ascend
from lmcache_backend.compat.profile import VllmProfile
from lmcache_backend.compat.versions import UnsupportedVersions, Versions, detect_versions, vkey
from lmcache_backend.compat.versions import nearest as nearest_of
from lmcache_backend.compat.versions import release as core_of
from lmcache_backend.compat.vllm import (
    INCOMPATIBLE,
    NEWEST_RELEASE,
    OLDEST_RELEASE,
    cpu_releases,
    neighbours,
    profile_for,
    verification,
)

logger = logging.getLogger(__name__)

#: A probe returns what the installed source lacks of a code path (empty: nothing).
Probe = Callable[[VllmProfile], list[str]]

ALLOW_HINT = "or set allow_untested_versions=true in kv_connector_extra_config to run it anyway"


@dataclass(frozen=True)
class Decision:
    """The gate's answer.

    Attributes:
        runs: whether the connector starts.
        message: one line: what runs and how it is verified, or why not and what to install.
        profile: the code path that runs, bound to the installed release (None when refused).
        row: the version-matrix row, where one applies.
        untested: the release has no record (run by probing or ``allow_untested_versions``).
    """

    runs: bool
    message: str
    profile: VllmProfile | None = None
    row: MatrixRow | None = None
    untested: bool = False


def _refuse(message: str, untested: bool = False) -> Decision:
    return Decision(False, message, untested=untested)


def _platform_name(platform: str) -> str:
    from lmcache_backend.device import PLATFORM_NAMES

    return PLATFORM_NAMES.get(platform, platform)


def _vllm_path(
    version: str, allow_untested: bool, probe: Probe | None
) -> tuple[VllmProfile | None, str, bool]:
    """``(profile, why, untested)`` for a vLLM release; profile None: refused, ``why`` says why.
    For a profile, ``why`` is empty or says how an unrecorded release got it."""
    profile = profile_for(version)
    if profile is not None:
        return profile, "", False
    if version in INCOMPATIBLE:
        near = nearest_of(version, [OLDEST_RELEASE, NEWEST_RELEASE])
        why = f"vLLM {version} is not supported: {INCOMPATIBLE[version]}"
        return None, f"{why}; nearest supported release: {near}", False
    before, after = neighbours(version)
    if before is not None and after is not None:  # between two ranges: probe the source
        for candidate in (after, before):
            if probe is not None and not probe(candidate):
                why = "not recorded; its installed source has every symbol this path uses"
                return dataclasses.replace(candidate, release=version), why, True
        if allow_untested:
            why = "not recorded and its source matches no code path; allow_untested_versions is set"
            return dataclasses.replace(after, release=version), why, True
        near = nearest_of(version, [before.last, after.first])
        return (
            None,
            (
                f"vLLM {version} is not recorded and its installed source matches neither the "
                f"{before.name} nor the {after.name} code path; nearest supported release: {near}, "
                f"{ALLOW_HINT}"
            ),
            True,
        )
    nearest = before if before is not None else after
    assert nearest is not None  # there is at least one profile
    edge = nearest.last if before is not None else nearest.first
    if not allow_untested:
        age = "untested with CacheBlend" if before is not None else "older than every code path"
        return (
            None,
            f"vLLM {version} is {age}; nearest supported release: {edge}, {ALLOW_HINT}",
            True,
        )
    why = "untested; allow_untested_versions is set"
    missing = probe(nearest) if probe is not None else []
    if missing:
        why += f"; its source lacks {len(missing)} symbol(s) of this path, e.g. {missing[0]}"
    return dataclasses.replace(nearest, release=version), why, True


def _ascend_check(versions: Versions, vllm: str, allow_untested: bool) -> tuple[str, bool]:
    """``(text, refused)`` for the installed vllm-ascend on an NPU: why it is refused (naming
    ``allow_untested_versions`` where that would help), or a note on an untested combination run
    anyway (empty: a recorded, supported one)."""
    supported = ", ".join(a.version for a in supported_ascend())
    if versions.vllm_ascend is None:
        return f"Ascend NPU without vllm-ascend: install vllm-ascend ({supported})", True
    asc = ascend_release(versions.vllm_ascend)
    installed = versions.vllm_ascend
    if asc is None:
        near = nearest_ascend(installed)
        if allow_untested:
            return f"vllm-ascend {installed} untested; allow_untested_versions is set", False
        return (
            f"vllm-ascend {installed} is untested with CacheBlend; nearest supported release: "
            f"vllm-ascend {near.version} (vLLM {near.vllm}), {ALLOW_HINT}"
        ), True
    if not asc.supported:
        near = nearest_ascend(asc.version)
        return (
            f"vllm-ascend {asc.version} (vLLM {asc.vllm}) is not supported: {asc.note}; nearest "
            f"supported release: vllm-ascend {near.version} (vLLM {near.vllm})"
        ), True
    if core_of(asc.vllm) != vllm:
        if allow_untested:
            return (
                f"vllm-ascend {asc.version} pins vLLM {asc.vllm}; allow_untested_versions is set",
                False,
            )
        return (
            f"vllm-ascend {asc.version} is built for vLLM {asc.vllm}, found vLLM {vllm}; "
            f"install vllm=={asc.vllm}, {ALLOW_HINT}"
        ), True
    return "", False


def decide(
    versions: Versions,
    platform: str,
    allow_untested: bool = False,
    probe: Probe | None = None,
) -> Decision:
    """Whether CacheBlend runs with these versions on ``platform``, and how (see the module
    docstring). ``probe`` checks a code path against the installed source; without one an
    unrecorded release matches no code path."""
    from lmcache_backend.device import unsupported_platform_reason

    if versions.vllm is None:
        return _refuse(
            "vLLM is not installed: install this package with the extra of your platform, "
            "[cuda], [cpu] or [ascend] (README, Install)"
        )
    refusal = unsupported_platform_reason(platform)
    if refusal is not None:
        return _refuse(refusal)
    if versions.lmcache is not None:
        row = matrix_row(versions.vllm, versions.lmcache)
        if row is not None and not row.status.runs:
            return _refuse(row.describe())
    vllm = core_of(versions.vllm) or versions.vllm
    where = f"vLLM {vllm}"
    notes: list[str] = []
    if platform == "npu":
        text, refused = _ascend_check(versions, vllm, allow_untested)
        if refused:  # untested when the setting would have let it run
            return _refuse(text, untested=ALLOW_HINT in text)
        where += f" + vllm-ascend {versions.vllm_ascend}"
        notes += [text] if text else []
    if platform == "cpu" and vkey(vllm) < vkey(cpu_releases()[0]):
        # no release this old has a CPU code path, recorded or not: name a CPU release
        in_range = profile_for(vllm)
        what = (
            f"the {in_range.name} code path has no CPU backend"
            if in_range is not None
            else "no code path for releases this old has a CPU backend"
        )
        return _refuse(
            f"vLLM {vllm} on CPU: {what}; nearest supported release on CPU: {cpu_releases()[0]}"
        )
    profile, why, untested = _vllm_path(vllm, allow_untested, probe)
    if profile is None:
        return _refuse(why, untested)
    if platform == "cpu" and not profile.has_cpu_path:  # a CPU-less path after a CPU one
        return _refuse(
            f"vLLM {vllm} on CPU: the {profile.name} code path has no CPU backend; nearest "
            f"supported release on CPU: {nearest_of(vllm, cpu_releases())}"
        )
    if platform == "npu":
        row = matrix_row(vllm, None, versions.vllm_ascend)
        # vllm-ascend's worker decides when the connector is created; for a release without a
        # record assume before the model is loaded, which the connector handles either way
        asc = ascend_release(versions.vllm_ascend)
        after_load = asc.kv_transfer_after_model_load if asc is not None else False
        profile = dataclasses.replace(profile, kv_transfer_after_model_load=after_load)
    else:
        row = matrix_row(vllm, None)
    notes += [why] if why else []
    untested = untested or bool(notes)
    how = ("; ".join(notes)) if notes else verification(vllm, platform)
    message = f"{where} on {_platform_name(platform)}: runs the {profile.name} code path ({how})"
    return Decision(True, message, profile, row if not untested else None, untested)


# -- this process ---------------------------------------------------------------------------

_admitted: dict[str, Decision] = {}


def installed_probe(profile: VllmProfile) -> list[str]:
    from lmcache_backend.compat.probe import installed_vllm_source, missing_symbols

    source = installed_vllm_source()
    return ["vLLM's source not found"] if source is None else missing_symbols(profile, source)


@functools.lru_cache(maxsize=2)
def installed_decision(allow_untested: bool = False) -> Decision:
    """:func:`decide` for the installed packages on the engine's platform (once per setting)."""
    from lmcache_backend.device import engine_platform

    return decide(detect_versions(), engine_platform(), allow_untested, installed_probe)


def admit(allow_untested: bool = False) -> VllmProfile:
    """Apply the gate in this process and return the code path that runs.

    The connector calls this first, with its ``allow_untested_versions``; what it admits is what
    :func:`current_profile` returns from then on in this process.

    Raises:
        UnsupportedVersions: the gate refuses; the message is the one-line decision.
    """
    decision = installed_decision(allow_untested)
    if not decision.runs or decision.profile is None:
        raise UnsupportedVersions(decision.message)
    (logger.warning if decision.untested else logger.info)("CacheBlend: %s", decision.message)
    _admitted["decision"] = decision
    return decision.profile


def current_profile() -> VllmProfile:
    """The code path admitted in this process; with nothing admitted yet (the model adapter
    used without a connector), the gate runs with its defaults.

    Raises:
        UnsupportedVersions: nothing was admitted and the gate refuses.
    """
    decision = _admitted.get("decision")
    return decision.profile if decision is not None else admit(False)  # type: ignore[return-value]


def code_path() -> VllmProfile | None:
    """The code path the installed release would run, tested or not, without refusing (for the
    plugin, which only records the model); None when no code path could run here at all."""
    decision = _admitted.get("decision")
    if decision is not None:
        return decision.profile
    return installed_decision(True).profile


def reset() -> None:
    """Forget what this process admitted and decided (tests, or after installing packages)."""
    _admitted.clear()
    installed_decision.cache_clear()
