"""`kvreuse bench cluster`: the chat and agent scenarios replayed (`bench replay --sessions`) against one
single-process server and against `kvreuse serve --replicas N` under each routing policy (ours, and Ray's own
character-prefix router as the peer), in one run.

Each server is started as a subprocess on a free port, warmed, replayed against, and stopped before the next, so
they never share the cores. Reported per server and scenario: exact hit rate, mean and p99 TTFT, throughput and
session affinity (the share of a chat session's turns its most used replica served), beside the targets:
cache_aware's hit rate within 5 points of the single server's and at least 1.5x round_robin's, its mean TTFT at
most 0.6x round_robin's; and the latency the Ray path adds per request (median TTFT of short one-token requests,
cluster minus single server).
"""

from __future__ import annotations

import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from kvreuse.bench import replay
from kvreuse.bench.engine_bench import machine
from kvreuse.bench.workloads import agent, chat, document_chat
from kvreuse.tuning.dtype_probe import cpu_identity

READY = re.compile(r"kvreuse ready: (http://127\.0\.0\.1:\d+)/v1")
READY_TIMEOUT_S = 600.0
PROBES = 15  # one-token requests timed for the Ray path's added latency


@contextmanager
def served(args: list[str], progress: Callable[[str], None]) -> Iterator[str]:
    """`kvreuse serve ARGS` on a free port; yields its root URL once ready; SIGTERM (then kill) on exit."""
    cmd = [sys.executable, "-m", "kvreuse", "serve", "--host", "127.0.0.1", "--port", "0", *args]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, bufsize=1)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)],
                     daemon=True).start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"`{' '.join(cmd)}` was not ready within {READY_TIMEOUT_S:.0f}s") from None
            if line is None:
                raise RuntimeError(f"`{' '.join(cmd)}` exited with {process.wait()} before it was ready")
            if match := READY.search(line):
                progress(line.strip())
                yield match.group(1)
                return
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def probe_ttft_ms(root: str) -> float:
    """Median time to the whole answer of a one-token greedy completion of a short prompt, caching off."""
    times = []
    with httpx.Client(trust_env=False, timeout=60) as client:
        for i in range(PROBES + 1):
            start = time.perf_counter()
            response = client.post(f"{root}/v1/completions", json={
                "model": client.get(f"{root}/v1/models").json()["data"][0]["id"], "prompt": f"Probe {i}: hello",
                "max_tokens": 1, "temperature": 0, "use_cache": False})
            response.raise_for_status()
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def run(replicas: int = 2, num_requests: int = 24, turns: int = 4, max_tokens: int = 16,
        server_args: tuple[str, ...] = (), progress: Callable[[str], None] = print) -> dict:
    workloads = {"chat": chat(num_requests, turns), "document-chat": document_chat(num_requests, turns),
                 "agent": agent(num_requests)}
    servers = {"single": [], "cache_aware": ["--replicas", str(replicas), "--set", "cluster.routing=cache_aware"],
               "round_robin": ["--replicas", str(replicas), "--set", "cluster.routing=round_robin"],
               "ray_prefix": ["--replicas", str(replicas), "--set", "cluster.routing=ray_prefix"]}
    results: dict[str, dict] = {}
    for name, args in servers.items():
        with served([*server_args, *args], progress) as root:
            row = {"probe_ttft_ms": probe_ttft_ms(root), "scenarios": {}}
            for scenario, conversations in workloads.items():
                row["scenarios"][scenario] = replay.run(root, conversations, max_tokens=max_tokens, sessions=True)
                r = row["scenarios"][scenario]
                progress(f"{name} / {scenario}: hit rate {r['exact_hit_rate']:.1%}, mean TTFT "
                         f"{r['mean_ttft_ms']:.0f} ms, affinity {r['session_affinity']}")
            results[name] = row
    return {"suite": "cluster", "replicas": replicas, "requests": num_requests, "turns": turns,
            "max_tokens": max_tokens, "cpu": cpu_identity(), "machine": machine(), "servers": results,
            "targets": targets(results)}


def targets(results: dict[str, dict]) -> dict:
    def rate(server: str, scenario: str) -> float:
        return results[server]["scenarios"][scenario]["exact_hit_rate"] or 0.0

    scenario = "document-chat"  # its sessions' own context: chat's is mostly the system prompt every replica holds
    ttft = {s: results[s]["scenarios"][scenario]["mean_ttft_ms"] for s in results}
    checks = {
        f"hit rate within 5 points of the single server ({scenario})": (
            rate("single", scenario) - rate("cache_aware", scenario), 0.05),
        f"hit rate >= 1.5x round_robin's ({scenario})": (
            1.5 * rate("round_robin", scenario) - rate("cache_aware", scenario), 0.0),
        f"mean TTFT <= 0.6x round_robin's ({scenario})": (ttft["cache_aware"] - 0.6 * ttft["round_robin"], 0.0),
        "Ray path adds < 20 ms per request": (
            results["cache_aware"]["probe_ttft_ms"] - results["single"]["probe_ttft_ms"] - 20.0, 0.0),
    }
    return {text: {"margin": gap, "met": gap <= limit} for text, (gap, limit) in checks.items()}


def markdown(report: dict) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = ["| server | scenario | hit rate | mean TTFT ms | p99 TTFT ms | req/s | session affinity | failed |",
             "|---" * 8 + "|"]
    for server, row in report["servers"].items():
        for scenario, r in row["scenarios"].items():
            lines.append(f"| {server} | {scenario} | {fmt(r['exact_hit_rate'], '.1%')} | {r['mean_ttft_ms']:.0f} | "
                         f"{r['p99_ttft_ms']:.0f} | {r['request_throughput']:.2f} | "
                         f"{fmt(r['session_affinity'], '.2f')} | {r['failed']} |")
    probes = ", ".join(f"{s} {row['probe_ttft_ms']:.1f} ms" for s, row in report["servers"].items())
    verdicts = "; ".join(f"{text}: {'met' if t['met'] else 'not met'}" for text, t in report["targets"].items())
    cpu = report["cpu"]
    lines += ["", f"{report['replicas']} replicas; chat and document-chat: {report['requests']} requests in "
                  f"sessions of {report['turns']} turns, agent: {report['requests']} steps; {report['max_tokens']} "
                  "tokens each. "
                  f"One-token probe, median: {probes}. CPU: {cpu['cpu']} ({', '.join(cpu['flags']) or 'no flags'}).",
              f"Targets: {verdicts}."]
    return "\n".join(lines)
