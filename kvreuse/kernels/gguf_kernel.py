"""The quantized-block decode kernel (`torch.ops.kvreuse_gguf.linear`, gguf_linear.cpp): built, loaded and chosen.

`load()` builds the extension with torch's C++ extension builder (ninja and a C++ compiler; ~20 s, once: the
result is kept under the cache directory, keyed by the source, torch's version and the compiler flags) and picks
the widest instruction set both this CPU and torch's dispatch allow. torch's `ATEN_CPU_CAPABILITY` lowers it as it
lowers torch's own kernels: `avx2` runs the AVX2 variant on an AVX-512 CPU, `default` none (the caller then
dequantizes and multiplies in torch, which is today's fp32 path). Any failure is a `KernelStatus` with its reason,
never an exception: the model still runs, on the fallback.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.model.cache_dir import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_linear.cpp")
CFLAGS = ("-O3", "-fopenmp")  # at::parallel_for is OpenMP in the headers: without it, one thread
ISAS = {1: "avx2", 2: "avx512"}
_TORCH_CAPABILITY = {"AVX512": 2, "AVX2": 1}  # torch.backends.cpu.get_cpu_capability() -> the widest we may run
_lock = threading.Lock()


@dataclass(frozen=True)
class KernelStatus:
    isa: int        # 0: no kernel (the torch fallback), 1: AVX2, 2: AVX-512
    reason: str     # why this one: the instruction set, or what kept the kernel from loading

    @property
    def name(self) -> str:
        return ISAS.get(self.isa, "torch")


@functools.cache
def load() -> KernelStatus:
    """Build (or reuse) and load the kernel; which variant this process runs, and why."""
    with _lock:
        try:
            _build()
        except Exception as exc:  # no compiler, no ninja, a build error: the fallback still computes the same
            logger.warning("GGUF decode kernel unavailable (%s: %s); decoding with dequantized weights",
                           type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
            return KernelStatus(0, f"build failed: {type(exc).__name__}")
    cpu = int(torch.ops.kvreuse_gguf.best_isa())
    allowed = _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), 0)
    isa = min(cpu, allowed)
    if isa == 0:
        why = "this CPU has no AVX2/FMA" if cpu == 0 else (
            f"ATEN_CPU_CAPABILITY={torch.backends.cpu.get_cpu_capability().lower()}")
        return KernelStatus(0, why)
    return KernelStatus(isa, f"{ISAS[isa]} ({'the CPU' if isa == cpu else 'ATEN_CPU_CAPABILITY'} limit)")


def build_dir() -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"gguf_linear-{key}"


def _build() -> None:
    from torch.utils.cpp_extension import load as load_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    load_extension(name="kvreuse_gguf_linear", sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                   extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False, verbose=False)

    @torch.library.register_fake("kvreuse_gguf::linear")
    def _(x, packed, out_features, bits, half_scales, isa):
        return x.new_empty(x.shape[0], out_features)


if __name__ == "__main__":  # `python -m kvreuse.kernels.gguf_kernel`: build now (make install does)
    logging.basicConfig(level=logging.INFO)
    print(f"GGUF decode kernel: {load().name} ({load().reason}); {build_dir()}")
