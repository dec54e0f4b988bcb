"""The first minutes of `make run`'s server as a newcomer meets them: `python -m kvreuse.bench.first_run --out DIR`.

Three starts of `kvreuse serve --log-level info` on the defaults, each timed from its ready line:
1. eager (`engine.compile = off`): the eager time of the probe request (64 tokens, ignore_eos);
2. first start, on empty caches (its own KVREUSE_CACHE_DIR for the decode step's graphs, the rest of the cache
   linked in, and an empty TORCHINDUCTOR_CACHE_DIR): the probe every `every_s` from the ready line until the decode
   step is compiled, then `after` more;
3. second start (the graphs built): the probe every `every_s`, `after` times: the first against the steady state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvreuse.bench.agent_report import machine
from kvreuse.bench.agent_systems import free_port
from kvreuse.cache_dir import cache_root

PROBE = {"prompt": "Write a short story about a lighthouse keeper and a storm.", "max_tokens": 64,
         "temperature": 0, "ignore_eos": True}
READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Probe:
    start: str        # "eager", "first" or "second"
    at_s: float       # since the ready line
    seconds: float    # the request's wall time
    compile: str      # the decode step's state when it was sent (/health)


def fresh_cache(root: Path) -> Path:
    """A KVREUSE_CACHE_DIR under `root` holding the real cache's entries but the decode step's graphs: a first start
    that builds them, with what `make install` prepared (kernels, dtype probe, tokenizers) as it was."""
    cache = root / "kvreuse-cache"
    cache.mkdir(parents=True, exist_ok=True)
    for entry in cache_root().glob("*"):
        if entry.name != "decode-graphs" and not (cache / entry.name).exists():
            (cache / entry.name).symlink_to(entry)
    return cache


@contextmanager
def served(env: dict[str, str], *args: str) -> Iterator[str]:
    """`kvreuse serve --log-level info ARGS` on a free port; its root URL once it printed its ready line."""
    port = free_port()
    command = [sys.executable, "-m", "kvreuse", "serve", "--log-level", "info", "--host", "127.0.0.1",
               "--port", str(port), *args]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
                                   env=env)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            for line in process.stdout:
                if line.startswith("kvreuse ready:") or time.monotonic() > deadline:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"`{' '.join(command)}` did not start: {log.read()[-2000:]}")
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def probes(root: str, start: str, every_s: float, after: int, max_s: float) -> list[Probe]:
    """The probe every `every_s` from now until the decode step is compiled (or failed, or `max_s` passed), then
    `after` more."""
    results, ready_at, remaining = [], time.monotonic(), after
    with httpx.Client(trust_env=False, timeout=600) as client:
        model = client.get(f"{root}/v1/models").json()["data"][0]["id"]
        while remaining > 0:
            state = client.get(f"{root}/health").json().get("compile", "unknown")
            sent = time.monotonic()
            answer = client.post(f"{root}/v1/completions", json={**PROBE, "model": model})
            answer.raise_for_status()
            results.append(Probe(start, sent - ready_at, time.monotonic() - sent, state))
            if state not in ("compiling", "unknown") or sent - ready_at > max_s:
                remaining -= 1
            time.sleep(max(0.0, sent + every_s - time.monotonic()))
    return results


def run(every_s: float, after: int, max_s: float) -> list[Probe]:
    with tempfile.TemporaryDirectory(prefix="kvreuse-first-run-") as tmp:
        env = {**os.environ, "KVREUSE_CACHE_DIR": str(fresh_cache(Path(tmp))),
               "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        results = []
        with served(env, "--set", "engine.compile=off") as root:
            results += probes(root, "eager", every_s, after, max_s)
        with served(env) as root:
            results += probes(root, "first", every_s, after, max_s)
        with served(env) as root:
            results += probes(root, "second", every_s, after, max_s)
        return results


def report(results: list[Probe]) -> str:
    eager = statistics.median(p.seconds for p in results if p.start == "eager")
    steady = statistics.median(p.seconds for p in results if p.start == "second")
    cpu = machine()
    lines = [f"CPU: {cpu.get('lscpu_model') or cpu['cpu']} ({', '.join(cpu['simd_flags'])}), {cpu['cores']} cores",
             f"probe: {PROBE['max_tokens']} tokens; eager median {eager:.2f} s, "
             f"compiled (second start) median {steady:.2f} s", "",
             "| start | s after ready | request s | x eager | decode step |", "|---|---|---|---|---|"]
    lines += [f"| {p.start} | {p.at_s:.0f} | {p.seconds:.2f} | {p.seconds / eager:.2f} | {p.compile} |"
              for p in results]
    first = [p.seconds / eager for p in results if p.start == "first"]
    second = [p for p in results if p.start == "second"]
    lines += ["", f"first start: worst request {max(first):.2f}x eager; second start: first request "
                  f"{second[0].seconds / steady:.2f}x its steady state"]
    return "\n".join(lines)


def publish(out: Path | None, name: str, title: str, text: str, results: list) -> None:
    """Print `text`; with `out`, write it as NAME.md under `title`, and `results` (dataclasses) as NAME.json."""
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
        (out / f"{name}.md").write_text(f"# {title}\n\n{text}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--after", type=int, default=3, help="probes after the decode step is compiled")
    parser.add_argument("--max-s", type=float, default=600.0, help="stop waiting for the compile after this")
    parser.add_argument("--out", type=Path, help="write first-run.json and first-run.md here")
    args = parser.parse_args(argv)
    results = run(args.every_s, args.after, args.max_s)
    publish(args.out, "first-run", "The first minutes of `make run`", report(results), results)


if __name__ == "__main__":
    main()
