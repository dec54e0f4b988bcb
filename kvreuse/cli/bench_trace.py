"""`kvreuse bench trace FILE` (replay a Mooncake-format trace through the cache simulator, per eviction policy and
capacity) and `kvreuse bench scenario-trace OUT` (write the scenario workloads as such a trace)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvreuse.cli.common import InputError, check_plots, log_level_flag, positive_int, progress
from kvreuse.layers.kv_format import FORMATS

TRACE_PNG = "trace_hit_rate_vs_capacity.png"


def add_trace(suites) -> None:
    """`bench trace`: the trace through the cache manager under each policy at each capacity."""
    from kvreuse.bench.trace import MOONCAKE_HASH_BLOCK_TOKENS
    from kvreuse.bench.trace_bench import DEFAULT_CAPACITIES, POLICY_NAMES

    trace = suites.add_parser("trace", help="replay a Mooncake-format trace through the cache manager: hit rate per "
                                            "eviction policy and capacity, beside Belady's MIN",
                              description="Each request's hash ids become tokens, replayed through the engine's own "
                                          "cache manager and eviction code without a model. Prints the prefix hit "
                                          "rate, prefill tokens saved and the tokens evictions cost.")
    trace.add_argument("trace_file", metavar="FILE", help="Mooncake JSONL: timestamp, input_length, output_length, "
                                                          "hash_ids per line")
    trace.add_argument("--tokens-per-hash", type=positive_int, default=MOONCAKE_HASH_BLOCK_TOKENS,
                       help="tokens each hash id becomes (default 512; smaller scales the trace down)")
    trace.add_argument("--hash-block-tokens", type=positive_int, default=MOONCAKE_HASH_BLOCK_TOKENS,
                       help="tokens per hash block in the trace itself (default 512, Mooncake's; 16 for "
                            "`bench scenario-trace`'s)")
    trace.add_argument("--block-size", type=positive_int,
                       help="cache.block_size of the replay (default: the largest divisor of --tokens-per-hash up "
                            "to 256)")
    trace.add_argument("--capacity", type=positive_int, nargs="+", metavar="C", default=list(DEFAULT_CAPACITIES),
                       help="cache capacities in hash blocks, requests in flight included (default "
                            f"{' '.join(map(str, DEFAULT_CAPACITIES))})")
    trace.add_argument("--pool-mb", type=float, metavar="MB",
                       help="instead of --capacity: a pool of MB megabytes of the model's K/V, held in each of "
                            "--kv-dtypes (the capacity each holds is what the run compares)")
    trace.add_argument("--kv-dtypes", nargs="+", choices=list(FORMATS), default=["bf16", "int8"],
                       metavar="DTYPE", help="cache.kv_dtype values compared with --pool-mb (default bf16 int8)")
    trace.add_argument("--model", default="", help="the model whose K/V bytes per token size --pool-mb (default: "
                                                    "the embedded model)")
    trace.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=list(POLICY_NAMES), metavar="POLICY",
                       help=f"{', '.join(POLICY_NAMES)} (default: all; belady is the offline optimum)")
    trace.add_argument("--out", metavar="DIR", help=f"directory for trace.json, trace.md and {TRACE_PNG}")
    log_level_flag(trace)
    trace.set_defaults(func=cmd_bench_trace)


def cmd_bench_trace(args: argparse.Namespace) -> int:
    """Replay the trace, print the tables; with --out also the report and the PNG."""
    from kvreuse.bench import trace_bench
    from kvreuse.bench.commands import write_report
    from kvreuse.bench.trace import TraceError, read_trace

    check_plots(args.out)
    block_size = args.block_size or trace_bench.default_block_size(args.tokens_per_hash)
    if block_size > trace_bench.MAX_BLOCK_SIZE or args.tokens_per_hash % block_size:
        raise InputError(f"--block-size {block_size} must divide --tokens-per-hash {args.tokens_per_hash} and be "
                         f"at most {trace_bench.MAX_BLOCK_SIZE}")
    try:
        requests = read_trace(args.trace_file)
    except (OSError, TraceError) as exc:
        raise InputError(str(exc)) from exc
    if not requests:
        raise InputError(f"{args.trace_file}: no requests")
    scale = trace_bench.Scale(args.tokens_per_hash, args.hash_block_tokens, block_size)
    held = (trace_bench.pool_capacities(args.pool_mb, args.kv_dtypes, args.tokens_per_hash, block_size, args.model)
            if args.pool_mb else {})
    capacities = sorted(set(held.values()) if held else set(args.capacity))
    report = trace_bench.run(requests, scale, capacities, list(dict.fromkeys(args.policies)),
                             progress=progress, name=Path(args.trace_file).name)
    if held:
        report.update(pool_mb=args.pool_mb, model=args.model or "the embedded model", kv_dtype_capacities=held)
    table = trace_bench.markdown(report)
    print(table)
    if args.out:
        from kvreuse.bench.plots import capacity_plot

        write_report(Path(args.out), "trace", report, table)
        print(f"wrote {capacity_plot(report, Path(args.out) / TRACE_PNG)}", file=sys.stderr)
    return 0


def add_scenario_trace(suites) -> None:
    """`bench scenario-trace`: the scenario workloads as a Mooncake-format trace."""
    from kvreuse.bench.trace_export import SessionMix

    mix = SessionMix()
    export = suites.add_parser("scenario-trace", help="write the scenario workloads as a Mooncake-format trace of "
                                                      "interleaved sessions (for `bench trace`)")
    export.add_argument("out_file", metavar="OUT", help="the JSONL file to write")
    export.add_argument("--sessions", type=positive_int, default=mix.num_sessions,
                        help=f"sessions (default {mix.num_sessions})")
    export.add_argument("--hash-block-tokens", type=positive_int, default=16,
                        help="tokens per hash block (default 16; replay with the same --hash-block-tokens)")
    export.add_argument("--seed", type=int, default=mix.seed, help=f"random seed (default {mix.seed})")
    log_level_flag(export)
    export.set_defaults(func=cmd_bench_scenario_trace)


def cmd_bench_scenario_trace(args: argparse.Namespace) -> int:
    """Tokenize the sessions with the default model's chat template and write the trace."""
    from kvreuse.analyze import load_tokenizer, tokenize
    from kvreuse.bench.trace import write_trace
    from kvreuse.bench.trace_export import SessionMix, scenario_trace
    from kvreuse.config import Config

    tokenizer, _ = load_tokenizer(Config())
    requests = scenario_trace(SessionMix(num_sessions=args.sessions, seed=args.seed),
                              lambda messages: tokenize(tokenizer, messages, False),
                              args.hash_block_tokens)
    path = write_trace(args.out_file, requests)
    blocks = sum(len(r.hash_ids) for r in requests)
    print(f"wrote {path}: {len(requests)} requests, {blocks} hash blocks of {args.hash_block_tokens} tokens "
          f"({len({h for r in requests for h in r.hash_ids})} distinct)")
    return 0
