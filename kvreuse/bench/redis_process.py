"""A real `redis-server` as a subprocess on a free 127.0.0.1 port, in a temp dir, persisting nothing: for
`kvreuse bench tiers` (tiers_bench.py), which starts one when it is given no URL, the live trace replays with a Redis
tier (live_trace_cluster.py) and the Redis tests (which add their faults in tests/redis_faults.py)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvreuse.extras import require

redis = require("redis", "redis", "a redis-server for the Redis tier's tests and bench")
INSTALL_HINT = "redis-server is not on PATH: install it with `apt-get install redis-server` (`make test` does)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisProcess:
    """`redis-server` on 127.0.0.1: started on construction, answering PING; `url` to reach it. Also a context
    manager that stops it on exit."""

    def __init__(self, maxmemory: str | None = None, policy: str = "allkeys-lru", ready_timeout: float = 10.0):
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(INSTALL_HINT)
        self.port = free_port()
        self.ready_timeout = ready_timeout
        self._dir = tempfile.TemporaryDirectory(prefix="kvreuse-redis-")
        self.cmd = [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no",
                    "--save", "", "--appendonly", "no", "--dir", self._dir.name]
        if maxmemory is not None:
            self.cmd += ["--maxmemory", maxmemory, "--maxmemory-policy", policy]
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "redis.log"

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "redis-server is already running"
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + self.ready_timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode} before answering PING: "
                                       f"{' '.join(self.cmd)}\n{self.log_path.read_text(errors='replace')[-3000:]}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer PING within {self.ready_timeout:.0f}s: "
                                       f"{' '.join(self.cmd)}\n{self.log_path.read_text(errors='replace')[-3000:]}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
