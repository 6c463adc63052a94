"""Build the vLLM runtime bundle from PyPI: ``python tools/build_vllm_bundle.py`` (``make
vllm-bundle``).

Output (git-ignored, never installed by the package), by default ``.cache/vllm-bundle/``:

* ``vllm-<version>-python.zip``: the release's ``vllm/`` package without its compiled
  extensions and C++/CUDA sources, its ``.dist-info`` (vLLM's CUDA detection reads the installed
  ``vllm`` distribution's version), and the stand-ins of ``standin/`` in place of the two
  extensions the check's path imports;
* ``wheels-cp312/``: :data:`spec.DEPENDENCIES` as PyPI's cp312 manylinux wheels;
* ``manifest.json``: versions, sha256 of every file, sizes, the stand-ins.

``--rehearsal`` builds ``.cache/vllm-bundle-rehearsal/`` instead, for the CPU rehearsal on this
machine: the same pins as wheels for this interpreter, without the GPU-torch-only ones, plus the
GPU machine's packages this machine's torch/transformers do not bring (``gpu_python.py``).

The build fails, naming the total, when the bundle is over the 64 MiB the GPU machine accepts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import spec

HERE = Path(__file__).resolve().parent
#: fixed time stamp of the zip's entries, so that a rebuild gives the same bytes
_EPOCH = (2026, 1, 1, 0, 0, 0)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(pins: list[str], dest: Path, python_version: str) -> None:
    """``pip download`` of exact pins as binary wheels for ``python_version`` on manylinux."""
    tag = python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp", "--abi", f"cp{tag}"]
    cmd += ["--abi", "abi3", "--abi", "none"]
    for platform in spec.PLATFORMS:
        cmd += ["--platform", platform]
    cmd += ["--platform", "any", "-d", str(dest), *pins]
    subprocess.run(cmd, check=True)


def _skipped(name: str) -> bool:
    return name.endswith(spec.SKIPPED_SUFFIXES) or name in spec.SKIPPED_FILES


def _add(zout: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, _EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    zout.writestr(info, data, compresslevel=9)


def python_zip(wheel: Path, out: Path) -> dict:
    """Write the release's Python files, dist-info and the stand-ins into ``out``."""
    kept = skipped = 0
    stand_ins = {target: (HERE / "standin" / source) for source, target in spec.STAND_INS.items()}
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w") as zout:
        for name in sorted(zin.namelist()):
            if name.endswith("/") or name in stand_ins:
                continue
            if _skipped(name):
                skipped += 1
                continue
            _add(zout, name, zin.read(name))
            kept += 1
        for target, source in sorted(stand_ins.items()):
            _add(zout, target, source.read_bytes())
    return {"files": kept, "left_out": skipped, "stand_ins": sorted(stand_ins)}


def _fetch_vllm(work: Path) -> Path:
    _pip_download([f"vllm=={spec.VLLM_VERSION}"], work, spec.PYTHON_VERSION)
    wheel = work / spec.VLLM_WHEEL
    got = sha256(wheel)
    if got != spec.VLLM_SHA256:
        raise SystemExit(f"{wheel.name}: sha256 {got}, expected {spec.VLLM_SHA256}")
    return wheel


def _files(folder: Path) -> dict[str, dict]:
    return {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def build(out: Path, wheel: Path | None = None) -> dict:
    """The bundle for the GPU machine in ``out``; its manifest. ``wheel``: vLLM's wheel already
    on disk (its sha256 is checked), else it is downloaded and deleted afterwards."""
    out.mkdir(parents=True, exist_ok=True)
    zip_path = out / f"vllm-{spec.VLLM_VERSION}-python.zip"
    with tempfile.TemporaryDirectory(prefix="vllm-bundle-") as tmp:
        source = wheel or _fetch_vllm(Path(tmp))
        if sha256(source) != spec.VLLM_SHA256:
            raise SystemExit(f"{source}: not vLLM {spec.VLLM_VERSION}'s released CUDA wheel")
        contents = python_zip(source, zip_path)
    wheels = out / f"wheels-cp{spec.PYTHON_VERSION.replace('.', '')}"
    shutil.rmtree(wheels, ignore_errors=True)
    _pip_download(list(spec.DEPENDENCIES), wheels, spec.PYTHON_VERSION)
    return _finish(out, zip_path.name, wheels.name, spec.PYTHON_VERSION, contents)


def build_rehearsal(out: Path, bundle: Path, have: set[str]) -> dict:
    """The rehearsal's wheels (this interpreter) in ``out``; ``have``: the distributions the
    rehearsal's venv already holds (canonical names)."""
    from packaging.utils import canonicalize_name

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    skip = set(spec.GPU_TORCH_ONLY)
    pins = [p for p in spec.DEPENDENCIES if spec.name_of(p) not in skip]
    pins += [
        p
        for p in spec.GPU_MACHINE
        if canonicalize_name(spec.name_of(p)) not in have and spec.name_of(p) not in skip
    ]
    wheels = out / f"wheels-cp{version.replace('.', '')}"
    shutil.rmtree(wheels, ignore_errors=True)
    _pip_download(pins, wheels, version)
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    return _finish(out, None, wheels.name, version, {"python_zip_from": str(bundle), **manifest})


def _finish(out: Path, zip_name: str | None, wheels: str, python: str, contents: dict) -> dict:
    files = _files(out)
    total = sum(f["bytes"] for f in files.values())
    manifest = {
        "vllm": spec.VLLM_VERSION,
        "vllm_wheel": {"name": spec.VLLM_WHEEL, "sha256": spec.VLLM_SHA256},
        "python": python,
        "python_zip": zip_name,
        "wheels": wheels,
        "dependencies": sorted(p.name for p in (out / wheels).glob("*.whl")),
        "contents": contents,
        "files": files,
        "total_bytes": total,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    if zip_name is not None and total > spec.CARRY_LIMIT:
        raise SystemExit(
            f"the bundle is {total / (1 << 20):.1f} MiB, over the {spec.CARRY_LIMIT >> 20} MiB "
            "the GPU machine accepts"
        )
    return manifest
