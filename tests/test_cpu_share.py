"""The engine's thread count follows its CPU share (kvreuse/engine/cpu_share.py): the rule on given samples, then the
real thing against CPU-bound processes on every CPU this process may use."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from kvreuse.config import EngineConfig
from kvreuse.engine.cpu_share import (
    MIN_FREE_CPUS,
    CpuSample,
    FairShare,
    FixedThreads,
    can_sample_cpu,
    cpus_available,
    sample_cpu,
    thread_policy,
)


def window(waiting: float, free: float, wall: float = 1.0) -> tuple[CpuSample, CpuSample]:
    return CpuSample(10.0, 3.0, 100.0), CpuSample(10.0 + wall, 3.0 + waiting * wall, 100.0 + free * wall)


@pytest.mark.parametrize("threads, waiting, free, expected", [
    (2, 0.0, 0.0, 2),     # quiet, the team spinning on both CPUs
    (2, 0.1, 0.0, 2),     # our own event loop now and then: k = 0.22
    (2, 1 / 3, 0.0, 1),   # one CPU-bound neighbour on 2 CPUs: k = 1
    (2, 0.5, 0.0, 1),     # two: never below one thread
    (8, 0.2, 0.0, 6),     # k = 2 of 8
    (1, 0.0, 0.1, 1),     # a neighbour keeps the other CPU busy
    (1, 0.0, 1.0, 2),     # it left
    (2, 0.0, 1.0, 2),     # at the top already
    (4, 0.0, 2.5, 6),     # two CPUs free: two threads back
])
def test_the_rule(threads, waiting, free, expected):
    share = FairShare(8 if threads > 2 else 2)
    share.threads = threads
    assert share.decide(*window(waiting, free)) == expected


def test_a_fixed_count_is_kept():
    assert isinstance(thread_policy(EngineConfig(threads=1)), FixedThreads)
    assert thread_policy(EngineConfig(threads=3)).threads == 3


def test_the_default_is_at_most_the_cpus_this_process_may_use():
    policy = thread_policy(EngineConfig())
    assert 1 <= policy.threads <= cpus_available()
    script = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
              "from kvreuse.engine.cpu_share import cpus_available; print(cpus_available())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1"]


def _burner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@pytest.mark.skipif(not can_sample_cpu() or cpus_available() < 2, reason="needs Linux's schedstat and 2 CPUs")
def test_threads_give_way_to_cpu_bound_neighbours_and_come_back():
    """One CPU-bound process per CPU: the engine's share drops to one thread; once they are gone, it grows back."""
    cpus = min(cpus_available(), torch.get_num_threads())
    seen: list[int] = []
    phase = {"stop": False}

    def engine_thread():  # parallel work as an engine step does it, adjust() before each step
        share = FairShare(cpus)
        x = torch.randn(2_000_000)
        while not phase["stop"]:
            seen.append(share.adjust())
            for _ in range(20):
                x.mul_(1.0000001).add_(1e-7)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not (seen and seen[-1] == cpus) and time.monotonic() < deadline:
            time.sleep(0.2)
        if seen[-1] < cpus:
            pytest.skip(f"other programs keep this machine's CPUs busy: {seen[-1]} of {cpus} threads before the test")
        burners = [_burner() for _ in range(cpus)]
        try:
            deadline = time.monotonic() + 20
            while seen[-1] > 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert seen[-1] == 1, f"still {seen[-1]} threads beside {cpus} CPU-bound processes"
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
        before, deadline = sample_cpu(), time.monotonic() + 20
        while seen[-1] < cpus and time.monotonic() < deadline:
            time.sleep(0.2)
        after = sample_cpu()
        free = (after.free_cpu_s - before.free_cpu_s) / (after.at_s - before.at_s)
        if seen[-1] < cpus and free < MIN_FREE_CPUS:
            pytest.skip(f"other programs kept this machine's CPUs busy after the neighbours left ({free:.2f} free)")
        assert seen[-1] == cpus, f"{seen[-1]} threads of {cpus} after the neighbours left, {free:.2f} CPUs free"
    finally:
        phase["stop"] = True
        thread.join()


def test_a_new_stepping_thread_starts_a_window_of_its_own():
    """The server warms the engine up on a passing thread, then steps it on the engine thread: the first window on the
    engine thread must not mix the two threads' CPU waits (which once read as neighbours and took a thread away)."""
    samples = iter([CpuSample(0.0, 100.0, 0.0), CpuSample(1.0, 0.0, 0.0), CpuSample(2.0, 0.0, 0.0)])
    share = FairShare(2, sample=lambda: next(samples))
    share.adjust()                              # the warm-up's thread: 100 s waited so far
    worker = threading.Thread(target=share.adjust)
    worker.start()                              # the engine thread: its own counter starts at 0
    worker.join()
    assert share.threads == 2
