"""Background work (grammar compiles, the decode step's compile) runs at a lower CPU priority than serving.

A large schema keeps xgrammar's threads busy for seconds, twice (the check process, then the compile for use); the
decode step's compile keeps inductor and g++ busy for minutes. On a machine with few cores that work would take its
share from the engine's steps and the event loop, and every request would wait on it. At BACKGROUND_NICENESS it gets
the cores that serving leaves idle.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading

BACKGROUND_NICENESS = 10  # Linux's weight at nice 10 is about a tenth of nice 0's


def lower_priority() -> None:
    """Lower the calling thread's CPU priority to BACKGROUND_NICENESS; the threads it starts afterwards (xgrammar's,
    made per compile) inherit it. Linux only, where the priority is per thread; elsewhere nothing changes."""
    if sys.platform != "linux":
        return
    thread_id = threading.get_native_id()
    if os.getpriority(os.PRIO_PROCESS, thread_id) < BACKGROUND_NICENESS:
        os.setpriority(os.PRIO_PROCESS, thread_id, BACKGROUND_NICENESS)


def background_command() -> list[str]:
    """The prefix that starts a command at BACKGROUND_NICENESS (`nice`), or none where there is no `nice`."""
    nice = shutil.which("nice")
    return [nice, "-n", str(BACKGROUND_NICENESS)] if nice else []
