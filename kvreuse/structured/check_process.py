"""A compile timed in a child process that is killed at its deadline.

xgrammar's compile cannot be interrupted inside a thread, and some formats of a few kilobytes take minutes. Checked
here first, such a compile costs no more than its deadline, and nothing of it keeps running afterwards: the
process is killed, and a new one started at once (a few seconds: it imports xgrammar). Only a format that
compiled in time is compiled again, for use, in the server's own process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import xgrammar as xgr

from kvreuse.background import background_command
from kvreuse.structured.formats import FormatSpec

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # importing xgrammar (and torch) on a busy machine
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding kvreuse/

Verdict = float | str  # compile seconds (math.inf: past the deadline), or the engine's reason for refusing it


class CompileCheck:
    """One check process for one tokenizer, one check at a time (a caller waits for the checks before its own, each
    at most its deadline). Thread-safe."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo):
        self._tokenizer_info = tokenizer_info
        self._setup: bytes | None = None  # the tokenizer as the process reads it (~1.6 MB), made at its first start
        self._proc: subprocess.Popen | None = None
        self._ready = False  # the process has read the tokenizer and answered
        self._buffer = b""
        self._lock = threading.Lock()
        self.starts = 0  # processes started
        self.kills = 0  # checks that ran past their deadline

    def run(self, spec: FormatSpec, timeout_s: float) -> Verdict:
        """How compiling `spec` went: its seconds, math.inf if it ran past `timeout_s` (the process was killed), or
        the engine's message refusing it. RuntimeError if the process cannot start."""
        request = (json.dumps({"kind": spec.kind, "value": spec.value}) + "\n").encode()
        with self._lock:
            try:
                proc = self._sent(request)
            except BrokenPipeError:  # it exited since the last check: once more, with a new one
                self._stop()
                proc = self._sent(request)
            try:
                line = self._read_line(time.monotonic() + timeout_s)
            except EOFError:
                self._stop()
                return f"compiling it ended the check process (exit {proc.returncode}; out of memory?)"
            if line is None:
                self.kills += 1
                self._stop()
                self._spawn()  # its successor starts now, while nothing waits for it
                logger.warning("a %s ran past structured.compile_timeout_s = %g s in the compile check process, "
                               "which was killed", spec.kind, timeout_s)
                return math.inf
        reply = json.loads(line)
        return reply["seconds"] if "seconds" in reply else reply["error"]

    @property
    def pid(self) -> int | None:
        """The check process's id while one runs."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _sent(self, request: bytes) -> subprocess.Popen:
        proc = self._started()
        proc.stdin.write(request)
        proc.stdin.flush()
        return proc

    def _started(self) -> subprocess.Popen:
        """The process, ready for a check: started if there is none (or it exited), waited for if it is starting."""
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._spawn()
        if not self._ready:
            try:
                self._ready = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S) is not None
            except EOFError:
                pass
            if not self._ready:
                code = self._proc.poll()
                self._stop()
                raise RuntimeError(f"the grammar compile check process did not start (exit {code}); "
                                   f"structured.compile_timeout_s = 0 compiles without it, unbounded")
        return self._proc

    def _spawn(self) -> None:
        self.starts += 1
        if self._setup is None:
            self._setup = (json.dumps({"tokenizer_info": self._tokenizer_info.serialize_json()}) + "\n").encode()
        # Run from the directory this kvreuse is in (`-m` puts it first on the path): the same code, whatever the
        # current directory holds.
        # At low priority from its first instruction: starting it (Python, torch, xgrammar) takes seconds of CPU.
        self._proc = subprocess.Popen([*background_command(), sys.executable, "-m", "kvreuse.structured.check_worker"],
                                      cwd=_PACKAGE_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # The tokenizer fills the pipe before the process, still importing, reads it: written beside.
        threading.Thread(target=_write, args=(self._proc.stdin, self._setup), daemon=True,
                         name="kvreuse-grammar-check-setup").start()

    def _read_line(self, deadline: float) -> bytes | None:
        """The process's next answer line; None at the deadline. EOFError if it exited."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self._proc.wait()
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                try:
                    pipe.close()
                except OSError:  # what was left to write to the killed process (BrokenPipeError)
                    pass
        self._proc, self._ready, self._buffer = None, False, b""


def _write(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.flush()
    except (BrokenPipeError, ValueError):  # the process died, or was stopped, before it read it all
        pass
