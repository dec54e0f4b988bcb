"""The server loads its engine on a passing thread, so that the engine thread is the only one holding an OpenMP team
(kvreuse/engine/omp_thread.py). Each check runs in a fresh interpreter: pytest's own thread has run parallel
regions long before. A team shows as OS threads: with 2 torch threads, the first parallel region a thread runs starts
one worker, which lives as long as that thread."""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import os, time, torch
torch.set_num_threads(2)
def os_threads():  # once threads that are ending have ended (a joined thread's OS thread exits just after)
    counts = [len(os.listdir("/proc/self/task"))]
    while len(counts) < 5 or len(set(counts[-5:])) > 1:
        time.sleep(0.05)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts[-1]
def parallel_region(): torch.ones(4_000_000).sum()   # past torch's grain: runs as an OpenMP team
"""


def run(body: str) -> list[int]:
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(n) for n in out.stdout.split()]


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")


def test_a_team_started_on_a_passing_thread_ends_with_it():
    before, after_passing, after_main = run("""
        from kvreuse.engine.omp_thread import on_passing_thread
        before = os_threads()
        on_passing_thread(parallel_region)
        after_passing = os_threads()
        parallel_region()             # the same work on this thread leaves its worker behind
        print(before, after_passing, os_threads())
    """)
    assert after_passing == before and after_main == before + 1


def test_the_passing_thread_gives_back_the_result_or_the_error():
    from kvreuse.engine.omp_thread import on_passing_thread

    assert on_passing_thread(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad weights"):
        on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad weights")))


def test_meanwhile_runs_on_the_callers_thread_and_its_error_waits_for_the_load():
    import threading
    import time

    from kvreuse.engine.omp_thread import on_passing_thread

    seen = []

    def load() -> str:
        time.sleep(0.2)
        seen.append(("load", threading.current_thread().name))
        return "engine"

    caller = threading.current_thread().name
    assert on_passing_thread(load, meanwhile=lambda: seen.append(("meanwhile", threading.current_thread().name))) \
        == "engine"
    assert seen == [("meanwhile", caller), ("load", "kvreuse-load")]   # it ran while the load slept
    seen.clear()
    with pytest.raises(ImportError, match="no app"):
        on_passing_thread(load, meanwhile=lambda: (_ for _ in ()).throw(ImportError("no app")))
    assert seen == [("load", "kvreuse-load")]                          # raised once the load had ended


def test_ctrl_c_waits_for_the_passing_thread_then_stops():
    # With Python's own Ctrl-C handler, as `kvreuse serve` loads (it sets its own after). interrupt_main does nothing
    # where SIGINT is ignored, and a shell without job control starts its background jobs so: a CI run launched with
    # `&` failed here with "DID NOT RAISE" (2026-12-07). A fresh interpreter, its handler set first.
    interrupted, finished = run("""
        import _thread, signal
        from kvreuse.engine.omp_thread import on_passing_thread
        signal.signal(signal.SIGINT, signal.default_int_handler)
        finished = []
        def load():
            time.sleep(0.2)
            _thread.interrupt_main()  # Ctrl-C while the caller waits
            time.sleep(0.3)
            finished.append(True)
            return 1
        try:
            on_passing_thread(load)
            print(0, len(finished))
        except KeyboardInterrupt:
            print(1, len(finished))
    """)
    assert interrupted == 1 and finished == 1


def test_load_engine_leaves_the_callers_thread_without_a_team(tiny_model_dir):
    # The main thread starts a worker at its first parallel region after the load: it held no team before.
    after_load, after_region = run(f"""
        from kvreuse.config import load_config
        from kvreuse.server.async_engine import load_engine
        config = load_config(None, ["model.path={tiny_model_dir}", "model.dtype=fp32", "engine.compile=off",
                                    "engine.num_kv_blocks=64"])
        engine = load_engine(config)
        assert engine.front_end.max_model_len > 0
        after_load = os_threads()
        parallel_region()
        print(after_load, os_threads())
    """)
    assert after_region == after_load + 1
