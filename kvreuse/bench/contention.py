"""A 64-token answer beside CPU-bound neighbours: `python -m kvreuse.bench.contention --out DIR`.

Two `kvreuse serve` on the defaults, the decode step compiled: one with a fixed thread count (`engine.threads` = the
CPUs, the behaviour before the fair share) and one on the fair share (`engine.threads = 0`, engine/cpu_share.py).
Each round sends the probe to each server in turn, quiet and then beside 1 and 2 busy-looping processes at nice 0
(started half a second before it, killed after it), so the variants are interleaved. Medians per variant and load,
and their ratio to the same variant's quiet median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvreuse.bench.agent_report import machine
from kvreuse.bench.first_run import PROBE, publish, served
from kvreuse.engine.cpu_share import cpus_available

SETTLE_S = 0.5  # the neighbours' start, before the probe
COMPILED_WAIT_S = 600.0


@dataclass(frozen=True)
class Probe:
    variant: str
    neighbours: int
    round: int
    seconds: float


def neighbour() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def wait_compiled(client: httpx.Client, root: str) -> None:
    deadline = time.monotonic() + COMPILED_WAIT_S
    while client.get(f"{root}/health").json().get("compile") not in ("compiled", "failed", "eager"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{root}: the decode step is not compiled after {COMPILED_WAIT_S:.0f} s")
        time.sleep(5)


def run(rounds: int, loads: list[int]) -> list[Probe]:
    variants = {f"fixed {cpus_available()} threads": ["--set", f"engine.threads={cpus_available()}"],
                "fair share": []}
    results = []
    with ExitStack() as stack, httpx.Client(trust_env=False, timeout=600) as client:
        roots = {name: stack.enter_context(served(dict(os.environ), *args)) for name, args in variants.items()}
        models = {}
        for name, root in roots.items():
            wait_compiled(client, root)
            models[name] = client.get(f"{root}/v1/models").json()["data"][0]["id"]
            client.post(f"{root}/v1/completions", json={**PROBE, "model": models[name]}).raise_for_status()
        for round_index in range(rounds):
            for load in loads:
                for name, root in roots.items():
                    neighbours = [neighbour() for _ in range(load)]
                    try:
                        time.sleep(SETTLE_S if load else 0.0)
                        sent = time.monotonic()
                        client.post(f"{root}/v1/completions", json={**PROBE, "model": models[name]}).raise_for_status()
                        results.append(Probe(name, load, round_index, time.monotonic() - sent))
                    finally:
                        for process in neighbours:
                            process.kill()
                            process.wait()
                    time.sleep(SETTLE_S)  # the fair share sees the CPUs free again
    return results


def report(results: list[Probe]) -> str:
    cpu = machine()
    lines = [f"CPU: {cpu.get('lscpu_model') or cpu['cpu']} ({', '.join(cpu['simd_flags'])}), {cpu['cores']} cores; "
             f"probe: {PROBE['max_tokens']} tokens, decode step compiled; "
             f"{len({p.round for p in results})} interleaved rounds", "",
             "| variant | CPU-bound neighbours | median s | x its quiet median | runs |", "|---|---|---|---|---|"]
    for variant in dict.fromkeys(p.variant for p in results):
        quiet = statistics.median(p.seconds for p in results if p.variant == variant and p.neighbours == 0)
        for load in sorted({p.neighbours for p in results}):
            runs = [p.seconds for p in results if p.variant == variant and p.neighbours == load]
            median = statistics.median(runs)
            lines.append(f"| {variant} | {load} | {median:.2f} | {median / quiet:.2f} | "
                         f"{', '.join(f'{s:.2f}' for s in runs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, nargs="+", default=[0, 1, 2], help="CPU-bound neighbours per probe")
    parser.add_argument("--out", type=Path, help="write contention.json and contention.md here")
    args = parser.parse_args(argv)
    results = run(args.rounds, args.loads)
    publish(args.out, "contention", "A 64-token answer beside CPU-bound neighbours", report(results), results)


if __name__ == "__main__":
    main()
