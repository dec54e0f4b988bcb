"""Timing work on a device whose kernels run asynchronously: wait for the device before reading the clock, and the
GEMM peak of a model's linears measured on the device itself."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

GEMM_REPEATS = 10


def synchronize(device: torch.device | str) -> None:
    """Wait until every kernel queued on `device` has run (nothing to wait for on a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_on(device: torch.device | str, fn: Callable[[], object]) -> float:
    """Seconds `fn` takes, its kernels on `device` included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def gemm_seconds(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, device: torch.device | str) -> float:
    """Median seconds of one pass over linears of (in, out) `shapes` with `rows` input rows, on `device`, after one
    warm-up pass."""
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(rows, i, generator=g).to(device, dtype), (torch.randn(o, i, generator=g) * i ** -0.5)
              .to(device, dtype)) for i, o in shapes]

    def one_pass() -> None:
        for x, w in pairs:
            F.linear(x, w)

    one_pass()
    return statistics.median(timed_on(device, one_pass) for _ in range(GEMM_REPEATS))
