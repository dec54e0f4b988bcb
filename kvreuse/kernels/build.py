"""kvreuse's CPU extension (`torch.ops.kvreuse_cpu`): the GGUF block product (gguf_linear.cpp), the fused decode
attention (decode_attention.cpp), the row-by-row prefill attention (prefill_attention.cpp; both attention kernels
compute a query row through attention_rows.h), the 8-bit KV formats' Hadamard rotation (hadamard.cpp) and a layer's
norms, RoPE and gated activations (pointwise.cpp), built, loaded and chosen.

`load()` builds the extension with torch's C++ extension builder (ninja and a C++ compiler; ~1 min on 2 cores, once:
the result is kept under the cache directory, keyed by the sources, torch's version and place, and the flags). The
GGUF product runs the widest instruction set both this CPU and torch's dispatch allow: torch's `ATEN_CPU_CAPABILITY`
lowers it as it lowers torch's own kernels (`avx2` runs the AVX2 variant on an AVX-512 CPU, `default` none). The
attention kernels are plain C++ and run on any CPU (a bf16 pool's scores in bf16 pairs where it has AVX-512 BF16,
unless `KVREUSE_BF16_DOT=0`). `KVREUSE_CPU_KERNELS=0` loads nothing: every op then runs in pure torch, the reference
the kernels are tested against. A build failure is a `KernelStatus` with its reason, never an exception.
Builders take an OS lock on the build directory (`builder_lock`), which dies with its process: torch's own lock file,
which a killed build leaves behind and every later build then waits on forever, is cleared under it. They build from
copies of the sources kept in that directory, so every checkout of the same sources shares one build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from kvreuse.cache_dir import cache_root

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gguf_linear.cpp", "decode_attention.cpp", "prefill_attention.cpp", "hadamard.cpp",
                             "pointwise.cpp"))
# Included by the sources: kept beside their copies, and keyed with them.
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("isa.h", "attention_rows.h", "gguf_linear_body.h", "hadamard.h", "bf16.h"))
CFLAGS = ("-O3", "-fopenmp")  # at::parallel_for is OpenMP in the headers: without it, one thread


class Isa(IntEnum):
    """The kernels' instruction sets, as the ops take them: isa.h's `kvreuse::Isa`, value for value."""
    NONE = 0
    AVX2 = 1
    AVX512 = 2


ISAS = {Isa.AVX2: "avx2", Isa.AVX512: "avx512"}
_TORCH_CAPABILITY = {"AVX512": Isa.AVX512, "AVX2": Isa.AVX2}  # torch.backends.cpu.get_cpu_capability() -> widest
_lock = threading.Lock()
_status: KernelStatus | None = None  # load()'s answer


@dataclass(frozen=True)
class KernelStatus:
    loaded: bool    # the extension is loaded: the attention kernels run
    isa: Isa        # the GGUF product's variant: NONE (dense weights in torch), AVX2, AVX512
    reason: str     # why: the instruction set, or what kept the extension from loading

    @property
    def name(self) -> str:
        return ISAS.get(self.isa, "none")


def load() -> KernelStatus:
    """Build (or reuse) and load the extension, once per process: what this process runs, and why. Called on the
    hot path (each decode layer's attention), so the answer is kept; the engine's thread and the compile thread may
    ask first at the same time, and the extension must be registered once."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _load()
    return _status


def _load() -> KernelStatus:
    if os.environ.get("KVREUSE_CPU_KERNELS", "1") == "0":
        return KernelStatus(False, Isa.NONE, "KVREUSE_CPU_KERNELS=0")
    try:
        _build()
    except Exception as exc:  # no compiler, no ninja, a build error: the torch ops compute the same
        last = str(exc).strip().splitlines()[-1:] or [""]
        logger.warning("kvreuse's CPU kernels unavailable (%s: %s); running pure torch ops", type(exc).__name__,
                       last[0])
        return KernelStatus(False, Isa.NONE, f"build failed: {type(exc).__name__}")
    cpu = Isa(torch.ops.kvreuse_cpu.best_isa())
    capability = torch.backends.cpu.get_cpu_capability()
    isa = min(cpu, _TORCH_CAPABILITY.get(capability, Isa.NONE))
    if isa == Isa.NONE:
        return KernelStatus(True, Isa.NONE, "this CPU has no AVX2/FMA" if cpu == Isa.NONE else
                            f"ATEN_CPU_CAPABILITY={capability.lower()}")
    return KernelStatus(True, isa, ISAS[isa] if isa == cpu else f"{ISAS[isa]}, as ATEN_CPU_CAPABILITY allows")


def build_dir() -> Path:
    """Keyed by the sources, the flags, and torch's version and place: the build file names torch's headers by path,
    so two environments (a checkout's and a clean clone's) sharing one directory rebuilt in turn (~9 s each)."""
    torch_dir = str(Path(torch.__file__).resolve().parent)
    digest = hashlib.sha256("\0".join([torch.__version__, torch_dir, *CFLAGS]).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return cache_root() / "kernels" / f"kvreuse_cpu-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def builder_lock(directory: Path):
    """Hold `directory` for one builder across processes. The lock is the kernel's (flock), so a killed holder frees
    it; while it is held no other builder runs, so a torch lock file found then was left by a killed build."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "builder.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"  # torch.utils.file_baton's
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> None:
    from torch.utils.cpp_extension import load as load_extension

    directory = build_dir()
    with builder_lock(directory):
        load_extension(name="kvreuse_cpu", sources=[str(s) for s in _stable_sources(directory)],
                       extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], build_directory=str(directory),
                       is_python_module=False, verbose=False)

    @torch.library.register_fake("kvreuse_cpu::gguf_linear")
    def _(x, packed, out_features, bits, group, half_scales, isa):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("kvreuse_cpu::decode_attention")
    def _(q, k, v, k_cache, v_cache, slot_mapping, context_slots, context_lens, scale, rotated=False):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake("kvreuse_cpu::prefill_attention")
    def _(q, k_cache, v_cache, context_slots, row_seq, row_pos, window, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake("kvreuse_cpu::hadamard")
    def _(x):
        return torch.empty_like(x)

    @torch.library.register_fake("kvreuse_cpu::rms_norm")
    def _(x, weight, eps, round_first):
        return x.new_empty(x.shape)

    @torch.library.register_fake("kvreuse_cpu::rotary")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("kvreuse_cpu::gated")
    def _(gate_up, activation):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("kvreuse_cpu::scaled")
    def _(x, s):
        return x.new_empty(x.shape)


def _stable_sources(directory: Path) -> list[Path]:
    """The sources (and the headers they include, beside them), copied into the build directory once: ninja's build
    file names its sources' paths, so building from each checkout's own files made every other checkout (a clone, an
    installed copy) rebuild in turn. The directory is keyed by their contents, so the copies are these files. Returns
    the sources' copies."""
    copies = []
    for source in (*SOURCES, *HEADERS):
        copy = directory / source.name
        if not copy.exists():
            temp = copy.with_suffix(f".{os.getpid()}.tmp")
            temp.write_bytes(source.read_bytes())
            temp.replace(copy)
        copies.append(copy)
    return copies[:len(SOURCES)]


if __name__ == "__main__":  # `python -m kvreuse.kernels.build`: build now (make install does)
    logging.basicConfig(level=logging.INFO)
    status = load()
    print(f"kvreuse CPU kernels: {'loaded' if status.loaded else 'not loaded'}, GGUF product {status.name} "
          f"({status.reason}); {build_dir()}")
    raise SystemExit(0 if status.loaded else 1)
