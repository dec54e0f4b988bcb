"""`FaultyRedis`: the package's `RedisProcess` (kvreuse/bench/redis_process.py, which the benches start too) with the
faults the tier tests inject: SIGKILL, and a restart on the same port."""

from __future__ import annotations

from kvreuse.bench.redis_process import RedisProcess


class FaultyRedis(RedisProcess):
    """A redis-server of our own that a test may kill and restart."""

    def kill(self) -> None:
        """SIGKILL: Redis dies without closing anything itself (the kernel still resets its sockets)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def restart(self) -> None:
        """Stopped, then started again on the same port, empty (it saves nothing)."""
        self.stop()
        self.start()
