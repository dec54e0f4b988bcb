"""Live trace replays (`bench replay --trace`) against one server and against `kvreuse serve --replicas N` under each
routing policy, without and with a shared Redis tier: Mooncake's local-against-global cache comparison at our scale.

`python -m kvreuse.bench.live_trace_cluster --trace NAME=FILE,start=0,count=80,tokens_per_hash=8,time_scale=1 ...
--out DIR` (after the file, live_trace.run's options of that trace, and its slice). Each server is started, replayed
against (every trace, one after another, each under its own token seed so no two traces share a block), and stopped
before the next; a server with the tier gets a fresh redis-server of its own. Targets, per trace and tier setting:
cache_aware's hit rate at least 1.3x round_robin's, with a lower mean TTFT.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from kvreuse.bench import live_trace
from kvreuse.bench.cluster_bench import served
from kvreuse.bench.engine_bench import machine
from kvreuse.bench.redis_process import RedisProcess
from kvreuse.bench.trace import read_trace
from kvreuse.tuning.dtype_probe import cpu_identity

POLICIES = ("cache_aware", "round_robin", "ray_prefix")
HIT_RATE_RATIO = 1.3


def servers(replicas: int, redis: bool) -> dict[str, tuple[list[str], bool]]:
    """Name -> (`kvreuse serve` arguments, whether it gets a Redis tier): one server, then each policy, then with
    `redis` each policy again over a shared tier."""
    cluster = {p: ["--replicas", str(replicas), "--set", f"cluster.routing={p}"] for p in POLICIES}
    chosen = {"single": ([], False), **{p: (args, False) for p, args in cluster.items()}}
    if redis:
        chosen |= {f"{p}+redis": (args, True) for p, args in cluster.items()}
    return chosen


def run(traces: dict[str, tuple[list, dict]], options: dict, replicas: int = 2, server_args: tuple[str, ...] = (),
        redis: bool = True, about: dict[str, dict] | None = None, only: list[str] | None = None,
        progress: Callable[[str], None] = print) -> dict:
    """Replay each of `traces` (name -> (TraceRequest list, its own live_trace.run options over `options`)) against
    each server (those of `only` in its order, where given); `about` (name -> where the trace came from) goes into
    the report."""
    results: dict[str, dict] = {}
    chosen = servers(replicas, redis)
    for name in only or chosen:
        args, with_redis = chosen[name]
        with ExitStack() as stack:
            tier = []
            if with_redis:
                tier = ["--set", f"cache.redis.url={stack.enter_context(RedisProcess()).url}"]
            root = stack.enter_context(served([*server_args, *args, *tier], progress))
            results[name] = {}
            for seed, (trace, (requests, own)) in enumerate(traces.items()):
                r = live_trace.run(root, requests, seed=seed, **{**options, **own})
                r.pop("per_request")
                results[name][trace] = r
                progress(f"{name} / {trace}: hit rate {r['exact_hit_rate']:.1%}, mean TTFT {r['mean_ttft_ms']:.0f} ms, "
                         f"late {r['late_arrivals']}, {r['duration']:.0f} s, replicas {r['replicas']}")
    return {"suite": "live-trace-cluster", "replicas": replicas, "server_args": list(server_args), "options": options,
            "traces": {name: {**(about or {}).get(name, {}), "requests": len(requests), **own}
                       for name, (requests, own) in traces.items()},
            "cpu": cpu_identity(), "machine": machine(), "servers": results, "targets": targets(results)}


def targets(results: dict[str, dict]) -> dict:
    """Per trace and tier setting: cache_aware's hit rate against 1.3x round_robin's, and its mean TTFT against
    round_robin's (margins: how far from the bound, <= 0 met)."""
    checks = {}
    for suffix in ("", "+redis"):
        aware, robin = results.get(f"cache_aware{suffix}"), results.get(f"round_robin{suffix}")
        if aware is None or robin is None:
            continue
        for trace in aware:
            a, r = aware[trace], robin[trace]
            ratio = (a["exact_hit_rate"] or 0) / r["exact_hit_rate"] if r["exact_hit_rate"] else None
            checks[f"{trace}{suffix}: hit rate >= {HIT_RATE_RATIO}x round_robin's"] = {
                "ratio": ratio, "met": ratio is None and bool(a["exact_hit_rate"]) or (ratio or 0) >= HIT_RATE_RATIO}
            checks[f"{trace}{suffix}: mean TTFT below round_robin's"] = {
                "ratio": a["mean_ttft_ms"] / r["mean_ttft_ms"], "met": a["mean_ttft_ms"] < r["mean_ttft_ms"]}
    return checks


def markdown(report: dict) -> str:
    cells = live_trace.TABLE_HEADER.removeprefix("|")
    lines = [f"| server | trace |{cells}", "|---" * (2 + cells.count("|")) + "|"]
    for server, rows in report["servers"].items():
        for trace, r in rows.items():
            lines.append(f"| {server} | {trace} " + live_trace.row(r))
    cpu = report["cpu"]
    verdicts = "; ".join(f"{text}: {'met' if t['met'] else 'not met'} ({fmt_ratio(t['ratio'])})"
                         for text, t in report["targets"].items())
    traces = "; ".join(f"{name}: {', '.join(f'{k} {v}' for k, v in spec.items())}"
                       for name, spec in report["traces"].items())
    options = ", ".join(f"{k} {v}" for k, v in report["options"].items())
    lines += ["", f"{report['replicas']} replicas. Traces: {traces}. All: {options}. CPU: {cpu['cpu']} "
                  f"({', '.join(cpu['flags']) or 'no flags'}).", f"Targets: {verdicts}."]
    return "\n".join(lines)


def fmt_ratio(ratio: float | None) -> str:
    return "round_robin's is 0" if ratio is None else f"{ratio:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvreuse.bench.live_trace_cluster", description=__doc__)
    parser.add_argument("--trace", action="append", required=True, metavar="NAME=FILE[,KEY=VALUE...]",
                        help="a trace to replay, named; after it its slice (start, count) and its own options "
                             "(tokens_per_hash, hash_block_tokens, time_scale); repeatable")
    parser.add_argument("--max-output-tokens", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--no-redis", action="store_true", help="skip the servers with a shared Redis tier")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config key for every server started; repeatable")
    parser.add_argument("--servers", nargs="+", metavar="NAME", choices=list(servers(2, redis=True)),
                        help="only these servers, in this order (default: all)")
    parser.add_argument("--out", metavar="DIR", help="directory for report.json and report.md")
    args = parser.parse_args(argv)
    traces, about = {}, {}
    for item in args.trace:
        name, _, spec = item.partition("=")
        path, *pairs = spec.split(",")
        own = {key: float(value) if key == "time_scale" else int(value)
               for key, _, value in (pair.partition("=") for pair in pairs)}
        start, count = own.pop("start", 0), own.pop("count", None)
        traces[name] = (read_trace(path)[start:None if count is None else start + count], own)
        about[name] = {"file": Path(path).name, "start": start}
    options = {"max_output_tokens": args.max_output_tokens}
    progress = lambda line: print(line, file=sys.stderr, flush=True)
    report = run(traces, options, args.replicas, tuple(a for o in args.overrides for a in ("--set", o)),
                 redis=not args.no_redis, about=about, only=args.servers,
                 progress=progress)
    table = markdown(report)
    print(table)
    if args.out:
        from kvreuse.bench.commands import write_report

        write_report(Path(args.out), "report", report, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
