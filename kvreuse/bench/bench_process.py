"""A `kvreuse bench SUITE` command run in a process of its own, as a user runs it, under a time limit: a crash, a
hang or a device error ends that process, not the caller. Its report and table are read back from `--out`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvreuse.bench.check_steps import CheckFailed
from kvreuse.bench.llamacpp_peer import describe_exit

TAIL_LINES = 40
# Its own process group, so that a timeout kills its workers too; not its own session, which a machine that ends a
# command's processes (the device tool's) would leave running after the caller was stopped, and which Linux's
# autogroup would give a CPU share of its own. Python 3.10's Popen has no process_group: setpgid before the exec.
GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-TAIL_LINES:])


def run_bench(suite: str, args: list[str], out: Path, timeout_s: float) -> tuple[dict, str]:
    """Run `python -m kvreuse bench <suite> <args> --out <out>`, its output logged to `out`/<suite>.log; its report
    (<suite>.json) and table (<suite>.md). CheckFailed, with the log's tail, if it fails or outlives `timeout_s`."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kvreuse", "bench", suite, *args, "--out", str(out)]
    log = out / f"{suite}.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"}, **GROUP)
        try:
            code = process.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its whole group: workers it started too
            process.wait()
            code = None
    details = {"command": " ".join(command), "log_tail": _tail(log)}
    if code is None:
        raise CheckFailed(f"`kvreuse bench {suite}` ran past {timeout_s:.0f} s and was killed", details)
    if code != 0:
        raise CheckFailed(f"`kvreuse bench {suite}` failed ({describe_exit(code)})", details)
    report = json.loads((out / f"{suite}.json").read_text())
    return {"command": details["command"], "report": report}, (out / f"{suite}.md").read_text().rstrip()
