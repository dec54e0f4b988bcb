"""The decode step's compiled graphs on disk (torch's AOT precompile): built once per model, torch, kvreuse and CPU by
a process of their own at the lowest CPU priority, then loaded by every engine in seconds.

Compiling in the serving process starved it: inductor's Python holds the GIL and its g++ runs take both cores, so for
the ~3 minutes of a first compile a 2-core server decoded 10-50x slower than eagerly, and even a compile that inductor's
cache held took ~20 s of the serving thread's time. Here the build runs in a child process at nice 19, which gets the
cores only when serving leaves them idle; the server keeps decoding eagerly meanwhile, and then loads the artefacts
(`torch.compiler.load_compiled_function`: no tracing, no compiling).

A directory per key holds one file per row bucket and, written last, `key.json`: a directory without it is unfinished.
The key names everything the graphs depend on (`graph_key`), the model's structure included, so an artefact is never
loaded into a model it was not built from. The .bin files hold inductor's generated code; the machine code it loads
is inductor's own on-disk cache (TORCHINDUCTOR_CACHE_DIR), which the build fills, and which a load rebuilds (g++, a
few seconds a kernel) where it was cleared.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvreuse.cache_dir import cache_root, write_json_atomically
from kvreuse.kernels import build as kernels
from kvreuse.tuning.dtype_probe import cpu_identity

GRAPH_VERSION = 1
SOURCES = ("model", "layers", "kernels")  # the packages whose code the graphs are made of
Bucket = tuple[int, int]


def graph_key(model: torch.nn.Module, buckets: list[Bucket]) -> dict:
    """What the compiled graphs of `model` for `buckets` depend on."""
    status = kernels.load()
    return {"version": GRAPH_VERSION, "torch": torch.__version__, **cpu_identity(), "source": source_digest(),
            "kernels": [status.loaded, status.isa], "model": model_digest(model),
            "buckets": [list(b) for b in buckets], "device": str(next(model.parameters()).device)}


def graph_dir(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_root() / "decode-graphs" / digest[:16]


def bucket_file(directory: Path, bucket: Bucket) -> Path:
    return directory / f"rows-{bucket[0]}-{bucket[1]}.bin"


def is_complete(directory: Path, key: dict) -> bool:
    """Every bucket's graph was built into `directory` for `key`."""
    try:
        return json.loads((directory / "key.json").read_text()) == key
    except (OSError, ValueError):
        return False


def mark_complete(directory: Path, key: dict) -> None:
    if not write_json_atomically(directory / "key.json", key, "keep the decode step's compiled graphs"):
        raise OSError(f"could not write {directory / 'key.json'}")


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Held while building into `directory`: two processes starting on one model build it once."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(directory: Path, buckets: list[Bucket]) -> list[Callable]:
    """Each bucket's compiled step, loaded from `directory` (complete). Their guards are off: the key chose them."""
    steps = []
    for bucket in buckets:
        with open(bucket_file(directory, bucket), "rb") as f:
            step = torch.compiler.load_compiled_function(f)
        step.disable_guard_check()
        steps.append(step)
    return steps


def source_digest() -> str:
    """sha256 of the package's code that the graphs are made of (SOURCES)."""
    root, digest = Path(__file__).resolve().parent.parent, hashlib.sha256()
    for path in sorted(p for package in SOURCES for p in (root / package).rglob("*")
                       if p.suffix in (".py", ".cpp", ".h")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's structure: each module's class and plain attributes, and the shape and dtype of every
    tensor it holds (parameters, buffers and packed weights alike), not their values."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}".encode())
        fields = {**vars(module), **module._parameters, **module._buffers}
        for field in sorted(fields):
            value = fields[field]
            if isinstance(value, torch.Tensor):
                digest.update(f"{field}={tuple(value.shape)}:{value.dtype}".encode())
            elif isinstance(value, int | float | str | bool | type(None)) and not field.startswith("_"):
                digest.update(f"{field}={value!r}".encode())
    return digest.hexdigest()
