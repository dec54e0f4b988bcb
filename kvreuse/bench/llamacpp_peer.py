"""llama-cpp-python as a peer of `kvreuse bench engine`, in a worker process of its own.

A peer that crashes becomes a failed row of the table, never the end of the bench: on an AMX Xeon the default
native build of llama.cpp died with a segmentation fault at its first `eval` (`make bench-peers` builds it without
AMX). The worker loads the GGUF once, then answers one JSON command per line on stdin with one JSON line on stdout:
`{"op": "prefill", "ids": [...]}` and `{"op": "decode", "ids": [...], "num_tokens": n}` give `{"seconds": s}`.
"""

from __future__ import annotations

import argparse
import json
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

CALL_TIMEOUT_S = 600.0


def describe_exit(returncode: int) -> str:
    """`SIGSEGV` for a worker a signal killed, else `exit N`."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


class LlamaCppPeer:
    """The bench's view of the worker: `prefill` and `decode` give seconds, or None once it has failed (`failure`
    then says how and where)."""

    name = "llama.cpp"

    def __init__(self, threads: int, command: Sequence[str] | None = None, model: str | None = None):
        """`model`: a GGUF path or model name (None: the embedded model)."""
        self.command = list(command or [sys.executable, "-m", "kvreuse.bench.llamacpp_peer",
                                        "--threads", str(threads), *(("--model", model) if model else ())])
        self.failure: str | None = None
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, bufsize=1)
        self._call({"op": "load"}, "load")

    def prefill(self, ids: list[int]) -> float | None:
        reply = self._call({"op": "prefill", "ids": ids}, "prefill")
        return None if reply is None else reply["seconds"]

    def decode(self, batch: list[list[int]], num_tokens: int) -> float | None:
        if len(batch) != 1:
            return None  # llama-cpp-python serves one sequence per context
        reply = self._call({"op": "decode", "ids": batch[0], "num_tokens": num_tokens}, f"decode ({num_tokens})")
        return None if reply is None else reply["seconds"]

    def _call(self, command: dict, what: str) -> dict | None:
        if self.failure is not None:
            return None
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
            line = self._read_line()
        except (BrokenPipeError, TimeoutError) as exc:
            line = "" if isinstance(exc, BrokenPipeError) else None
        if not line:
            self._fail(what, "timed out" if line is None else None)
            return None
        reply = json.loads(line)
        if "error" in reply:
            self.failure = f"{reply['error']} at {what}"
            return None
        return reply

    def _read_line(self) -> str:
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(CALL_TIMEOUT_S):
                raise TimeoutError
        return self.process.stdout.readline()

    def _fail(self, what: str, reason: str | None) -> None:
        if reason is None:
            returncode = self.process.wait(30)
            stderr = self.process.stderr.read().strip().splitlines()
            reason = describe_exit(returncode) + (f" ({stderr[-1][:200]})" if stderr else "")
        else:
            self.process.kill()
        self.failure = f"{reason} at {what}"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _serve(threads: int, model: str | None) -> None:
    from llama_cpp import Llama

    from kvreuse.weights.loader import resolve_model_path

    llm = None
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "load":
                llm = Llama(model_path=str(resolve_model_path(model)), n_ctx=4096, n_threads=threads, n_batch=512,
                            verbose=False)
                reply = {"ok": True}
            elif command["op"] == "prefill":
                llm.reset()
                start = time.perf_counter()
                llm.eval(command["ids"])
                reply = {"seconds": time.perf_counter() - start}
            else:  # decode: greedy, after the prompt's eval
                llm.reset()
                llm.eval(command["ids"])
                start = time.perf_counter()
                for _ in range(command["num_tokens"] - 1):
                    llm.eval([int(llm.sample(top_k=1))])
                reply = {"seconds": time.perf_counter() - start}
        except Exception as exc:  # reported, and the bench goes on without this peer
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--model", help="a GGUF path or model name (default: the embedded model)")
    arguments = parser.parse_args()
    _serve(arguments.threads, arguments.model)
