"""The KV pool's memory: zeros the OS gives on first touch, on a CPU.

torch.zeros writes every byte of a pool sized for the whole budget (0.7 s for 2 GiB, a tenth of a server's start)
and makes it all resident. calloc'd pages are zero until written, so a pool costs what its written blocks hold."""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGNMENT = 64  # bytes: a cache line, and an AVX-512 vector


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on a CPU its pages are the OS's zero pages until written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)  # calloc: no page is touched here
    start = -buffer.ctypes.data % ALIGNMENT
    return torch.from_numpy(buffer[start:start + nbytes]).view(dtype).view(shape)
