"""Load the model on a thread that ends with the load, so that the thread stepping the engine is the only one
holding an OpenMP team.

libgomp keeps a team of worker threads for every thread that ever ran a parallel region, until that thread ends.
While it manages more threads than there are CPUs it spins only briefly before sleeping, so with a second team alive
(the main thread's, from loading the model) every short parallel region of the engine thread waits for its workers
to wake: 121 GGUF products of a decode step took 2.3x as long on a 2-core machine, and a 1.6 MB sum 7x
(docs/design/performance.md). torch's own parallel ops and ours are alike in this.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T], name: str = "kvreuse-load", *,
                      meanwhile: Callable[[], object] | None = None) -> T:
    """`fn()` on a new thread that ends when it returns; its result, or its exception re-raised here. `meanwhile()`
    runs on the caller's thread in the meantime (work that runs no parallel torch op). Ctrl-C waits for `fn` to end,
    then raises: a thread left inside torch when the interpreter exits aborts the process."""
    result: list = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread, KeyboardInterrupt included
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    interrupted: BaseException | None = None
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException as exc:  # raised once `fn` has ended, for the same reason as Ctrl-C
            interrupted = exc
    while thread.is_alive():
        try:
            thread.join()
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted
    if failure:
        raise failure[0]
    return result[0]
