"""How many threads the engine's parallel ops use (torch's OpenMP team, our kernels' and the compiled step's).

A team of T threads on T cores waits at a barrier after every parallel region, hundreds per decode step. When another
program takes one of those cores, the thread that lost it holds up the whole team for a scheduler time slice at
every region, and a 64-token answer that a fair share would slow 1.5x took 3.5x as long (2 cores, one CPU-bound
neighbour; docs/bench/contention). `FairShare` follows the share the engine actually gets: fewer threads while its
thread waits for a CPU, more again once CPUs sit idle. docs/design/performance.md has the measurements.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvreuse.config import EngineConfig

logger = logging.getLogger(__name__)

WINDOW_S = 0.5           # the shortest time between two decisions
STALE_S = 5.0            # a longer gap (an idle engine) starts a new window without deciding
MIN_BUSY_NEIGHBOURS = 0.5  # the estimated CPU-bound neighbours that take a thread away
MIN_FREE_CPUS = 0.75     # the idle CPUs, averaged over a window, that give a thread back


class ThreadPolicy(Protocol):
    """Sets the calling thread's parallel width. `adjust()` is called by the engine thread before each step."""

    threads: int

    def adjust(self) -> int:
        """The thread count for the coming step, set with torch.set_num_threads on the calling thread."""


def cpus_available() -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's CPU quota (a container's `--cpus`)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period that the cgroup allows (v2 `cpu.max`, or v1's cfs quota), None if unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class CpuSample:
    at_s: float           # monotonic
    waited_s: float       # the calling thread's time runnable but not running, since it started
    free_cpu_s: float     # idle CPU time of the process's CPUs (idle, iowait, and niced work when we are not niced)


def sample_cpu() -> CpuSample:
    """A sample for the calling thread (Linux's schedstat and /proc/stat)."""
    at = time.monotonic()
    waited_ns = int(Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()[1])
    cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    count_niced = os.getpriority(os.PRIO_PROCESS, 0) <= 0  # our own time is niced time when we are niced
    free_ticks = 0
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if name in cpus:
                nice, idle, iowait = int(fields[1]), int(fields[3]), int(fields[4])
                free_ticks += idle + iowait + (nice if count_niced else 0)
            elif not name.startswith("cpu"):
                break
    return CpuSample(at, waited_ns / 1e9, free_ticks / os.sysconf("SC_CLK_TCK"))


def can_sample_cpu() -> bool:
    try:
        sample_cpu()
        return True
    except (OSError, ValueError, IndexError, AttributeError):
        return False


class FixedThreads:
    """`engine.threads = N`: always N threads."""

    def __init__(self, threads: int):
        self.threads = threads
        self._thread: int | None = None

    def adjust(self) -> int:
        if self._thread != threading.get_ident():  # OpenMP's count is per thread: set on each stepping thread
            self._thread = threading.get_ident()
            torch.set_num_threads(self.threads)
        return self.threads


class FairShare:
    """`engine.threads = 0`: up to `max_threads`, fewer while neighbours take CPUs. Over each window of at least
    WINDOW_S, the engine thread's waiting share w (time runnable but not running) estimates the CPU-bound
    neighbours: k = w * T / (1 - w) for T threads on T CPUs. k >= MIN_BUSY_NEIGHBOURS takes round(k) threads away
    (never below one); MIN_FREE_CPUS idle CPUs on average give one back per idle CPU."""

    def __init__(self, max_threads: int, sample=sample_cpu):
        self.max_threads = self.threads = max_threads
        self._sample = sample
        self._last: CpuSample | None = None
        self._thread: int | None = None  # the stepping thread of the last sample (the server warms up on another)

    def adjust(self) -> int:
        if self._thread != threading.get_ident():  # a new stepping thread: its own count, and a window of its own
            self._thread, self._last = threading.get_ident(), self._sample()
            torch.set_num_threads(self.threads)
        elif time.monotonic() - self._last.at_s >= WINDOW_S:
            now = self._sample()
            if now.at_s - self._last.at_s <= STALE_S:
                self._set(self.decide(self._last, now))
            self._last = now
        return self.threads

    def decide(self, before: CpuSample, now: CpuSample) -> int:
        """The thread count for the window from `before` to `now`."""
        wall = now.at_s - before.at_s
        waiting = min((now.waited_s - before.waited_s) / wall, 0.99)
        neighbours = waiting * self.threads / (1.0 - waiting)
        if self.threads > 1 and neighbours >= MIN_BUSY_NEIGHBOURS:
            return max(1, self.threads - max(1, round(neighbours)))
        free = (now.free_cpu_s - before.free_cpu_s) / wall
        if self.threads < self.max_threads and free >= MIN_FREE_CPUS:
            return min(self.max_threads, self.threads + max(1, math.floor(free + 1.0 - MIN_FREE_CPUS)))
        return self.threads

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            logger.info("engine threads %d -> %d (%s)", self.threads, threads,
                        "CPUs taken by other programs" if threads < self.threads else "CPUs free again")
            torch.set_num_threads(threads)
            self.threads = threads


def thread_policy(config: EngineConfig) -> ThreadPolicy:
    """`engine.threads`: N fixed, or 0 for the fair share of the CPUs this process may use (fixed where the kernel
    does not report what the fair share needs)."""
    if config.threads:
        return FixedThreads(config.threads)
    cpus = min(cpus_available(), torch.get_num_threads())
    return FairShare(cpus) if can_sample_cpu() and cpus > 1 else FixedThreads(cpus)
