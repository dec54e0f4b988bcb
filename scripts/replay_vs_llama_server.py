"""The multi-session chat replay against kvreuse and llama.cpp's llama-server, each started in turn on the same GGUF,
in interleaved rounds (A B, then B A, ...): 4 sessions x 6 turns x 64-token answers (`kvreuse bench replay URL chat
--sessions --turns 6 --requests 24 --max-tokens 64`) at each concurrency. Prints each run as it ends, then the
medians over the rounds and kvreuse's ratios to llama-server; `--out FILE` keeps every run's metrics as JSON.

llama-server is the one `make bench-peers` builds (scripts/build_llama_server.sh), with its defaults but one slot per
session (`--parallel 4`, 4096 tokens each) and the model's own chat template (`--jinja`), as kvreuse renders it.
`--checkout NAME=DIR` adds a kvreuse served from another checkout of the code (DIR/kvreuse, imported before this
one's), to compare two versions in the same rounds.

    .venv/bin/python scripts/replay_vs_llama_server.py [--rounds 3] [--concurrency 1 4] [--checkout before=DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kvreuse.bench.agent_systems import find_llama_server, served_command
from kvreuse.bench.replay import run_scenarios
from kvreuse.tuning.dtype_probe import cpu_identity
from kvreuse.weights.loader import embedded_model_path

MODEL = "SmolLM2-135M-Instruct"
SESSIONS, TURNS, MAX_TOKENS = 4, 6, 64
KEYS = {"mean_ttft_ms": "TTFT ms", "mean_tpot_ms": "TPOT ms", "request_throughput": "req/s"}


def systems(checkouts: list[str]) -> dict[str, list[str]]:
    """Each system's command line, host and port aside."""
    found = {"kvreuse": [sys.executable, "-m", "kvreuse", "serve"]}
    for given in checkouts:
        name, directory = given.split("=", 1)
        found[name] = ["env", f"PYTHONPATH={os.path.abspath(directory)}", sys.executable, "-m", "kvreuse", "serve"]
    found["llama-server"] = [str(find_llama_server()), "--model", str(embedded_model_path()), "--alias", MODEL,
                             "--jinja", "--ctx-size", str(4096 * SESSIONS), "--parallel", str(SESSIONS)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--out", help="every run's metrics, as JSON")
    args = parser.parse_args()
    commands = systems(args.checkout)
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in args.concurrency} for name in commands}
    for round_ in range(args.rounds):
        for name, command in (commands.items() if round_ % 2 == 0 else reversed(commands.items())):
            with served_command(command, lambda _: None) as root:
                for concurrency in args.concurrency:
                    report = run_scenarios(root, ["chat"], SESSIONS * TURNS, MAX_TOKENS, turns=TURNS,
                                           concurrency=concurrency, sessions=True, model=MODEL)
                    run = report["scenarios"]["chat"]
                    runs[name][concurrency].append(run)
                    print(f"{time.strftime('%H:%M:%S')} round {round_} {name} c={concurrency}: "
                          + ", ".join(f"{label} {run[key]:.2f}" for key, label in KEYS.items())
                          + f", failed {run['failed']}, load {os.getloadavg()[0]:.2f}", flush=True)
    cpu = cpu_identity()
    print(f"\nmedians of {args.rounds} rounds on {cpu['cpu']} ({cpu['machine']}, {os.cpu_count()} CPUs; "
          f"flags {' '.join(cpu['flags'])}):")
    print("| system | concurrency | " + " | ".join(KEYS.values()) + " | TPOT / llama-server | req/s / llama-server "
          "| TTFT / llama-server |")
    print("|---" * (5 + len(KEYS)) + "|")
    median = {name: {c: {k: statistics.median(r[k] for r in rs) for k in KEYS} for c, rs in by_c.items()}
              for name, by_c in runs.items()}
    for name, by_c in median.items():
        for c, m in by_c.items():
            peer = median["llama-server"][c]
            print(f"| {name} | {c} | " + " | ".join(f"{m[k]:.2f}" for k in KEYS)
                  + f" | {m['mean_tpot_ms'] / peer['mean_tpot_ms']:.2f}x"
                  + f" | {m['request_throughput'] / peer['request_throughput']:.2f}x"
                  + f" | {m['mean_ttft_ms'] / peer['mean_ttft_ms']:.2f}x |")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"cpu": cpu, "rounds": args.rounds, "runs": runs, "medians": median}, out,
                      indent=1)


if __name__ == "__main__":
    main()
