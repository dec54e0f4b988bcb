"""Start to the ready line of `kvreuse serve --model MODEL`, a first start (a fresh cache directory: the model's
assembly, its tokenizer's conversion, the dtype probe) against a second (the same directory again), interleaved
(first, second, first, second, ...). The CPU kernels `make install` built are shared by every directory, as they are
after an install. Prints each start, the medians and their ratio, with the CPU.

    .venv/bin/python scripts/start_time.py [--model gemma3-270m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvreuse.cache_dir import cache_root
from kvreuse.tuning.dtype_probe import cpu_identity

READY = "kvreuse ready:"


def start(model: str, cache_dir: Path, timeout_s: float = 600.0) -> float:
    """Seconds from launching the server to its ready line; the server is then stopped."""
    env = {**os.environ, "KVREUSE_CACHE_DIR": str(cache_dir)}
    began = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "kvreuse", "serve", "--model", model, "--port", "0"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:
            if line.startswith(READY):
                return time.perf_counter() - began
            if time.perf_counter() - began > timeout_s:
                break
        raise RuntimeError(f"no ready line from the server (exit {server.poll()})")
    finally:
        server.terminate()
        server.communicate(timeout=60)  # drains the pipe: a server blocked writing to it would never exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kernels = cache_root() / "kernels"
    firsts, seconds = [], []
    with tempfile.TemporaryDirectory(prefix="kvreuse-start-") as root:
        for r in range(args.rounds):
            cache_dir = Path(root) / f"round-{r}"
            cache_dir.mkdir()
            if kernels.is_dir():
                (cache_dir / "kernels").symlink_to(kernels)
            firsts.append(start(args.model, cache_dir))
            seconds.append(start(args.model, cache_dir))
            print(f"round {r + 1}: first {firsts[-1]:.1f} s, second {seconds[-1]:.1f} s", flush=True)
    first, second = statistics.median(firsts), statistics.median(seconds)
    cpu = cpu_identity()
    print(f"{cpu['cpu']} ({' '.join(cpu['flags'])}), {os.cpu_count()} cores\n"
          f"medians: first {first:.1f} s, second {second:.1f} s: {first / second:.2f}x")


if __name__ == "__main__":
    main()
