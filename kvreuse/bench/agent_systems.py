"""The systems `kvreuse bench agent` measures: servers it starts (kvreuse with caching on and off, llama.cpp's
llama-server) or servers given by URL, and how each started one is run and always stopped.

llama-server is started on a free port of 127.0.0.1 with the same GGUF as kvreuse, `--jinja` and the same
tools-capable chat template given to both servers (examples/chatml-hermes-tools.jinja: ChatML with Hermes
`<tool_call>` blocks, which llama-server parses into `tool_calls`; with SmolLM2's own template it ignores `tools`),
one slot per session (`-np`) with `LLAMA_SERVER_CTX_PER_SLOT` tokens each, and its prompt cache per slot on (its
default). The binary comes from `make bench-peers` (scripts/build_llama_server.sh installs .venv/bin/llama-server).

Every started server runs on a free port of 127.0.0.1, is ready when GET /health answers 200, and is measured only
once its process tree is idle (`wait_idle`: kvreuse compiles its decode step in a background thread after it is
ready, which would otherwise take the cores from its first run); it is stopped (SIGTERM, then kill) whatever happens.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

LLAMA_SERVER = "llama-server"
KVREUSE_SYSTEMS = {"kvreuse": [], "kvreuse-nocache": ["--set", "cache.enabled=false"]}  # `kvreuse serve` arguments
STARTED = (*KVREUSE_SYSTEMS, LLAMA_SERVER)
CHAT_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chatml-hermes-tools.jinja"
LLAMA_SERVER_CTX_PER_SLOT = 4096  # tokens of context per slot: a 6-step session with ~150-token results uses ~2k
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
IDLE_CPU_SHARE = 0.05     # a process tree using less than this share of one core over IDLE_WINDOW_S is idle
IDLE_WINDOW_S = 2.0
IDLE_TIMEOUT_S = 240.0    # measured anyway after this long (said in the progress line)


@dataclass
class System:
    """A system to measure. `url`: a server already running. Else the bench starts one: `kvreuse serve` with
    `server_args`, or, when `command` is set, that command line (llama-server's, without host and port)."""
    name: str
    url: str | None = None
    server_args: list[str] = field(default_factory=list)
    command: list[str] | None = None


def find_llama_server(binary: str | None = None) -> Path:
    """The llama-server to run: `binary` if given, else `llama-server` on PATH, else beside this Python (the
    virtual environment's bin/, where `make bench-peers` installs it). FileNotFoundError naming the build if none."""
    candidates = [Path(binary)] if binary else [
        *(Path(p) for p in [shutil.which(LLAMA_SERVER)] if p), Path(sys.executable).parent / LLAMA_SERVER]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"llama-server not found ({', '.join(str(c) for c in candidates)}): build it with `make bench-peers` "
        f"(scripts/build_llama_server.sh, ~10 minutes on 2 cores), or pass --llama-server PATH")


def llama_server_command(binary: Path | str, gguf: Path | str, chat_template: Path | str, slots: int,
                         alias: str, ctx_per_slot: int = LLAMA_SERVER_CTX_PER_SLOT) -> list[str]:
    """llama-server's command line, host and port aside: one slot per session, `ctx_per_slot` tokens each."""
    return [str(binary), "--model", str(gguf), "--alias", alias, "--jinja", "--chat-template-file",
            str(chat_template), "--ctx-size", str(ctx_per_slot * slots), "--parallel", str(slots)]


def started_systems(names: list[str], shared_args: list[str], *, sessions: int = 4, model: str | None = None,
                    chat_template: str | None = None, llama_server: str | None = None) -> list[System]:
    """The named systems the bench starts. kvreuse ones get `shared_args` (model, block size, --set) before their
    own, and `--chat-template` when one is given or llama-server is among them (both servers then render the same
    template); llama-server gets the GGUF of `model` (None: the embedded one) and one slot per session.
    ValueError for an unknown name, a model that is no GGUF file, or no llama-server binary."""
    unknown = [n for n in names if n not in STARTED]
    if unknown:
        raise ValueError(f"unknown system {unknown[0]!r}; choose from {', '.join(STARTED)}")
    template = chat_template or (str(CHAT_TEMPLATE) if LLAMA_SERVER in names else None)
    kvreuse_args = [*shared_args, *(("--chat-template", template) if template else ())]
    systems = []
    for name in names:
        if name == LLAMA_SERVER:
            systems.append(System(name, command=_llama_server_for(model, template, sessions, llama_server)))
        else:
            systems.append(System(name, server_args=[*kvreuse_args, *KVREUSE_SYSTEMS[name]]))
    return systems


def _llama_server_for(model: str | None, template: str, sessions: int, binary: str | None) -> list[str]:
    from kvreuse.server.lifecycle import model_name_of
    from kvreuse.weights.errors import ModelLoadError
    from kvreuse.weights.loader import resolve_model_path

    try:
        gguf = resolve_model_path(model)
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from exc
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise ValueError(f"llama-server needs a GGUF file; the model is {gguf}")
    try:
        found = find_llama_server(binary)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc
    return llama_server_command(found, gguf, template, sessions, model_name_of(gguf))


@contextmanager
def reachable(system: System, progress: Callable[[str], None]) -> Iterator[str]:
    """The system's root URL while it runs: as given, or of the server started for it (stopped on exit)."""
    if system.url is not None:
        yield system.url
        return
    command = system.command or [sys.executable, "-m", "kvreuse", "serve", *system.server_args]
    with served_command(command, progress) as root:
        yield root


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def served_command(command: list[str], progress: Callable[[str], None],
                   ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[str]:
    """`command --host 127.0.0.1 --port P` on a free port; yields its root URL once GET /health answers 200;
    SIGTERM (then kill) on exit, whatever happened. RuntimeError, with the end of its log, if it exits or is not
    ready in time."""
    port = free_port()
    cmd = [*command, "--host", "127.0.0.1", "--port", str(port)]
    root = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(process, root, log, ready_timeout_s)
            idle_s = wait_idle(process.pid)
            progress(f"ready at {root}, idle {idle_s:.0f} s later: {' '.join(cmd)}")
            yield root
        finally:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _wait_ready(process: subprocess.Popen, root: str, log, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"`{' '.join(process.args)}` exited with {process.returncode} before it was "
                                   f"ready: {_tail(log)}")
            try:
                if client.get(f"{root}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"`{' '.join(process.args)}` was not ready within {timeout_s:.0f}s: {_tail(log)}")
            time.sleep(0.2)


def _tail(log, chars: int = 1500) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:].strip()


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user and system) used so far by process `pid` and its live descendants; None without /proc."""
    parents, cpu = {}, {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name: state, ppid, ..., utime, stime
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if pid not in cpu:
        return None
    total = 0.0
    for child, seconds in cpu.items():
        ancestor = child
        while ancestor > 1 and ancestor != pid:
            ancestor = parents.get(ancestor, 0)
        total += seconds if ancestor == pid else 0.0
    return total


def wait_idle(pid: int, timeout_s: float = IDLE_TIMEOUT_S, window_s: float = IDLE_WINDOW_S,
              share: float = IDLE_CPU_SHARE) -> float:
    """Wait until process `pid` and its descendants use less than `share` of one core over `window_s`, at most
    `timeout_s`; the seconds waited (at once where /proc is missing)."""
    start = time.monotonic()
    before = tree_cpu_s(pid)
    while before is not None and time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        after = tree_cpu_s(pid)
        if after is None or after - before < share * window_s:
            break
        before = after
    return time.monotonic() - start
