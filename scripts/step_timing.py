"""Decode and prefill time of two checkouts of kvreuse, interleaved (A B A B, a process per run): the embedded SmolLM2
(or `--model ...` settings), greedy, caching off. Per model dtype and path (eager: `engine.compile=off`; compiled:
the defaults' graph, waited for): ms per decoded token at batch 1 (129 tokens less 1, after a 64-token prompt), and a
cold 2,048-token prefill's seconds. Prints the medians of `--rounds` runs and each checkout's ratio to the first.

    .venv/bin/python scripts/step_timing.py /path/to/before /path/to/after [--rounds 3] [--model-dtypes bf16 fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RUN = r"""
import json, sys, time
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

overrides, compiled = json.loads(sys.argv[1]), sys.argv[2] == "compiled"
sets = [*overrides, "server.max_tokens=4096"] + ([] if compiled else ["engine.compile=off"])
with LLM(load_config(None, sets)) as llm:
    if compiled:
        assert llm.wait_compiled(1800) == "compiled"
    prompt = [100 + (7 * i) % 5000 for i in range(64)]
    def seconds(ids, n):
        start = time.perf_counter()
        llm.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True), use_cache=False)
        return time.perf_counter() - start
    seconds(prompt, 16)                                                      # warm
    decode = [(seconds(prompt, 129) - seconds(prompt, 1)) / 128 * 1e3 for _ in range(3)]
    long_prompt = [100 + (13 * i) % 9000 for i in range(2048)]
    prefill = [seconds(long_prompt, 1) for _ in range(2)]
    print(json.dumps({"decode_ms": min(decode), "prefill_s": min(prefill)}))
"""


def run(checkout: str, overrides: list[str], path: str) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, "-c", RUN, json.dumps(overrides), path], env=env, cwd=checkout,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--paths", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--model", nargs="*", default=[], help="more settings: the model's path and chat template")
    args = parser.parse_args()
    from kvreuse.tuning.dtype_probe import cpu_identity
    print(f"CPU: {cpu_identity()}; {time.strftime('%Y-%m-%d')}", flush=True)
    for dtype in args.model_dtypes:
        for path in args.paths:
            overrides = [*args.model, f"model.dtype={dtype}"]
            for checkout in args.checkouts:  # each one's graphs built before anything is timed
                run(checkout, overrides, path)
            results = {c: [] for c in args.checkouts}
            for _ in range(args.rounds):
                for checkout in args.checkouts:
                    results[checkout].append(run(checkout, overrides, path))
            base = None
            for checkout, runs in results.items():
                decode = statistics.median(r["decode_ms"] for r in runs)
                prefill = statistics.median(r["prefill_s"] for r in runs)
                base = base or (decode, prefill)
                print(f"{dtype} {path} {checkout}: decode {decode:.2f} ms/token ({decode / base[0]:.3f}x), "
                      f"2k prefill {prefill:.2f} s ({prefill / base[1]:.3f}x); runs "
                      f"{[round(r['decode_ms'], 2) for r in runs]} {[round(r['prefill_s'], 2) for r in runs]}",
                      flush=True)


if __name__ == "__main__":
    main()
