"""Fetching a release: one slim zip of its Python sources per release.

A release is downloaded with ``pip download --no-deps`` (a vllm-ascend release published only as
an sdist is fetched from the simple index pip uses), its ``.py`` files and metadata are copied
into ``<cache>/<dist>-<version>.src.zip`` and the download is deleted; later runs read the zip.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from .releases import dist_name

#: The CUDA wheels of vLLM carry one of these platform tags, depending on the release.
VLLM_PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux1_x86_64",
]

SIMPLE_INDEX = "https://pypi.org/simple/{name}/"


def slim_path(cache: Path, package: str, version: str) -> Path:
    return cache / f"{dist_name(package)}-{version}.src.zip"


def write_slim(artifact: Path, slim: Path, package: str) -> None:
    """Copy the package's ``.py`` files (and metadata) of a wheel or sdist into ``slim``."""
    top = dist_name(package)
    files: dict[str, bytes] = {}
    if artifact.name.endswith(".whl"):
        with zipfile.ZipFile(artifact) as zf:
            for name in zf.namelist():
                if (name.startswith(top + "/") and name.endswith(".py")) or (
                    name.count("/") == 1 and name.endswith(".dist-info/METADATA")
                ):
                    files[name] = zf.read(name)
    elif artifact.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(artifact) as tf:
            for member in tf.getmembers():
                if not member.isfile():
                    continue
                name = member.name.split("/", 1)[1] if "/" in member.name else member.name
                if name in ("PKG-INFO", "Dockerfile", "requirements.txt") or (
                    name.startswith(top + "/") and name.endswith(".py")
                ):
                    extracted = tf.extractfile(member)
                    assert extracted is not None
                    files[name] = extracted.read()
    else:
        raise ValueError(f"not a wheel or sdist: {artifact}")
    meta = {"artifact": artifact.name, "sha256": hashlib.sha256(artifact.read_bytes()).hexdigest()}
    files["__artifact__.json"] = json.dumps(meta, sort_keys=True).encode()
    slim.parent.mkdir(parents=True, exist_ok=True)
    tmp = slim.with_suffix(".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(info, files[name])
    tmp.replace(slim)


def pip_download(package: str, version: str, dest: Path) -> Path | None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    if package == "vllm":
        cmd += ["--only-binary=:all:", "--python-version", "3.11"]
        for platform in VLLM_PLATFORMS:
            cmd += ["--platform", platform]
    else:
        cmd += ["--only-binary=:all:"]
    cmd.append(f"{package}=={version}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.iterdir())
    if proc.returncode != 0 or not found:
        return None
    return found[0]


def sdist_download(package: str, version: str, dest: Path) -> Path:
    """The release's sdist, from the PEP 691 simple index (pip would try to build it)."""
    req = urllib.request.Request(
        SIMPLE_INDEX.format(name=package),
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        index = json.load(resp)
    wanted = f"{dist_name(package)}-{version}.tar.gz"
    entry = next((f for f in index["files"] if f["filename"] == wanted), None)
    if entry is None:
        raise RuntimeError(f"{package}=={version}: no wheel for this platform and no {wanted}")
    with urllib.request.urlopen(entry["url"], timeout=600) as resp:
        data = resp.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{wanted}: sha256 mismatch")
    path = dest / wanted
    path.write_bytes(data)
    return path


def fetch(package: str, version: str, cache: Path, wheel_dir: Path | None, tmp_root: Path) -> Path:
    """The slim source zip of a release, downloading the release if it is not cached."""
    slim = slim_path(cache, package, version)
    if slim.exists():
        return slim
    if wheel_dir is not None:
        prefix = f"{dist_name(package)}-{version}"
        found = sorted(
            p
            for p in wheel_dir.iterdir()
            if p.name.startswith(prefix + "-") or p.name in (prefix + ".tar.gz",)
        )
        if not found:
            raise RuntimeError(f"no {prefix}-*.whl or {prefix}.tar.gz in {wheel_dir}")
        write_slim(found[0], slim, package)
        return slim
    tmp_root.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix=f"{dist_name(package)}-{version}-", dir=tmp_root))
    try:
        artifact = pip_download(package, version, dest)
        if artifact is None:
            if package == "vllm":
                raise RuntimeError(f"pip download vllm=={version} found no CUDA wheel")
            artifact = sdist_download(package, version, dest)
        write_slim(artifact, slim, package)
    finally:
        shutil.rmtree(dest, ignore_errors=True)  # the wheel is not kept
    return slim
