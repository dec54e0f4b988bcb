"""The KV pool's memory: zeros the OS gives on first touch, on a CPU.

torch.zeros writes every byte of a pool sized for the whole budget (0.7 s for 2 GiB, a tenth of a server's start)
and makes it all resident. Anonymous pages are zero until written, so a pool costs what its written blocks hold.
They are asked for as transparent huge pages (Linux's MADV_HUGEPAGE, where the kernel allows it): every first write
to a 4 KiB page is a fault, and a block's first write touches pages in every layer, which cost a warm chat turn
about 5 ms of its 35 on a 2-core VM (docs/design/performance.md)."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # bytes: the start is aligned to it (and so to a cache line and an AVX-512 vector)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on a CPU its pages are the OS's zero pages until written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # no page touched yet
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    buffer = np.frombuffer(memory, dtype=np.uint8)  # keeps `memory` mapped as long as the tensor lives
    start = -buffer.ctypes.data % HUGE_PAGE
    return torch.from_numpy(buffer[start:start + nbytes]).view(dtype).view(shape)
