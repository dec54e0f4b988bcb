"""`kvreuse bench scenario|replay|cluster`: the suites that run the built-in workloads (in-process, against any
OpenAI-compatible server, against --replicas N) rather than a synthetic prompt."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvreuse.bench.workloads import WORKLOADS
from kvreuse.cli.bench_live_trace import TRACE_ONLY_FLAGS, GivenFlag, add_trace_flags, cmd_replay_trace
from kvreuse.cli.common import (
    InputError,
    check_plots,
    common_flags,
    config_overrides,
    log_level_flag,
    out_flag,
    positive_int,
    progress,
    publish,
)


def _scenario_name(text: str) -> str:
    # A type check, not `choices`: argparse (3.11) rejects an empty nargs="*" list against choices.
    if text not in (*WORKLOADS, "all"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join([*WORKLOADS, 'all'])})")
    return text


def _scenario_names(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenarios", nargs="*", type=_scenario_name, metavar="SCENARIO",
                        help=f"{', '.join(WORKLOADS)} or all (default: all; prefix is SGLang's "
                             "generated-shared-prefix)")


def _chosen_scenarios(names: list[str]) -> list[str]:
    return list(WORKLOADS) if not names or "all" in names else list(dict.fromkeys(names))


def add_scenario(suites) -> None:
    """`bench scenario`: the workloads in-process in each reuse mode, beside HF transformers."""
    scenarios = f"scenarios ({', '.join(WORKLOADS)})"
    scenario = suites.add_parser("scenario", help=f"the {scenarios} in-process, in modes no-cache, prefix, shift, "
                                                  "blend, beside HF transformers",
                                 description=f"The {scenarios} in modes no-cache, prefix, shift, blend, "
                                             "each under its own preset unless --preset is given, beside HF "
                                             "transformers on the same weights; fidelity against no-cache.")
    common_flags(scenario)
    _scenario_names(scenario)
    scenario.add_argument("--quick", action="store_true", help="4 requests x 4 tokens (a smoke run)")
    scenario.add_argument("--requests", type=positive_int, help="requests per scenario (default 24; --quick: 4)")
    scenario.add_argument("--max-tokens", type=positive_int,
                          help="completion tokens per request (default 16; --quick: 4)")
    scenario.add_argument("--concurrency", type=positive_int,
                          help="requests in flight (default: each scenario's own; eval is a batch job)")
    scenario.add_argument("--no-peers", action="store_true", help="skip the HF transformers peers")
    out_flag(scenario, "scenario", ", and PNG plots (TTFT per mode, hit rate against block_size)")
    scenario.set_defaults(func=cmd_bench_scenario)


def cmd_bench_scenario(args: argparse.Namespace) -> int:
    """Run the chosen scenarios, each under its preset; print the table, with --out also the report and plots."""
    from kvreuse.bench import commands, scenario_bench

    check_plots(args.out)
    scenarios = _chosen_scenarios(args.scenarios)
    num_requests = args.requests or (4 if args.quick else 24)
    max_tokens = args.max_tokens or (4 if args.quick else 16)
    overrides = config_overrides(args)
    configs = {s: commands.scenario_config(s, args.config, overrides) for s in scenarios}
    report = scenario_bench.run(configs, num_requests, max_tokens, args.concurrency, peers=not args.no_peers,
                                progress=progress)
    table = scenario_bench.markdown(report)
    print(table)
    if args.out:
        commands.write_scenario_plots(Path(args.out), report, scenarios, num_requests,
                                      commands.scenario_config("none", args.config, overrides))
        commands.write_report(Path(args.out), "scenario", report, table)
    return 0


def add_cluster(suites) -> None:
    """`bench cluster`: chat and agent sessions against one server and against N replicas per routing policy."""
    cluster = suites.add_parser("cluster", help="chat and agent sessions against one server and against "
                                                "--replicas N under each routing policy, one at a time")
    cluster.add_argument("--replicas", type=positive_int, default=2, help="replicas (default 2)")
    cluster.add_argument("--requests", type=positive_int, default=24, help="requests per scenario (default 24)")
    cluster.add_argument("--turns", type=positive_int, default=4, help="turns per chat session (default 4)")
    cluster.add_argument("--max-tokens", type=positive_int, default=16, help="completion tokens (default 16)")
    cluster.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                         help="a config key for every server started; repeatable")
    out_flag(cluster, "cluster")
    log_level_flag(cluster)
    cluster.set_defaults(func=cmd_bench_cluster)


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    """Start the servers, run the sessions against each, print the table."""
    from kvreuse.bench import cluster_bench

    server_args = tuple(arg for item in args.overrides for arg in ("--set", item))
    try:
        report = cluster_bench.run(args.replicas, args.requests, args.turns, args.max_tokens, server_args,
                                   progress=progress)
    except RuntimeError as exc:
        raise InputError(str(exc)) from exc
    return publish("cluster", report, cluster_bench.markdown(report), args.out)


def add_replay(suites) -> None:
    """`bench replay`: the scenarios over HTTP against any OpenAI-compatible server."""
    replay = suites.add_parser("replay", help="the scenarios replayed against an OpenAI-compatible server",
                               description="The scenarios replayed over HTTP, streaming, against any "
                                           "OpenAI-compatible server (ours, vLLM, llama.cpp); keys as "
                                           "`vllm bench serve` names them.")
    replay.add_argument("url", metavar="URL", help="the server's root URL (with or without /v1)")
    _scenario_names(replay)
    replay.add_argument("--requests", type=positive_int, default=24, action=GivenFlag,
                        help="requests per scenario (default 24)")
    replay.add_argument("--max-tokens", type=positive_int, default=16, action=GivenFlag,
                        help="completion tokens per request (default 16)")
    replay.add_argument("--concurrency", type=positive_int, help="requests in flight (default: no cap)")
    replay.add_argument("--request-rate", type=float, default=float("inf"), action=GivenFlag,
                        help="Poisson arrivals per second (default inf: all at once)")
    replay.add_argument("--served-model", help="model name to send (default: the first of GET /v1/models)")
    replay.add_argument("--api-key", default="EMPTY", help="bearer token")
    replay.add_argument("--sessions", action="store_true",
                        help="send each chat session's turns in order (each after the previous reply), the sessions "
                             "side by side, as vLLM's multi-turn benchmark clients do")
    replay.add_argument("--turns", type=positive_int, help="turns per chat session (default 8)")
    add_trace_flags(replay)
    out_flag(replay, "replay", " (with --trace: live-trace.json and live-trace.md)")
    log_level_flag(replay)
    replay.set_defaults(func=cmd_bench_replay)


def cmd_bench_replay(args: argparse.Namespace) -> int:
    """Replay the chosen scenarios (or, with --trace, the trace) against the server at URL, print the table."""
    from kvreuse.bench import replay

    if args.trace is not None:
        return cmd_replay_trace(args)
    given = [flag for flag, dest in TRACE_ONLY_FLAGS.items() if getattr(args, dest) is not None]
    if given:
        raise InputError(f"{', '.join(given)} need --trace")
    try:
        report = replay.run_scenarios(args.url, _chosen_scenarios(args.scenarios), args.requests, args.max_tokens,
                                      model=args.served_model, concurrency=args.concurrency,
                                      request_rate=args.request_rate, api_key=args.api_key, sessions=args.sessions,
                                      turns=args.turns)
    except (RuntimeError, ValueError) as exc:
        raise InputError(str(exc)) from exc
    return publish("replay", report, replay.markdown(report), args.out)
