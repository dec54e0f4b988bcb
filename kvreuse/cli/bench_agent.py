"""`kvreuse bench agent`: an agent loop with tool calls, against servers the bench starts or given by URL."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from kvreuse.cli.common import (
    MODEL_HELP,
    InputError,
    check_plots,
    log_level_flag,
    out_flag,
    positive_int,
    progress,
    publish,
)

DEFAULT_SYSTEMS = ("kvreuse", "kvreuse-nocache")  # llama-server when asked: it needs `make bench-peers`
STARTED = ("kvreuse", "kvreuse-nocache", "llama-server")  # agent_systems.STARTED, without importing the bench


def add_agent(suites) -> None:
    """`bench agent`: N concurrent sessions x K steps of tool calls; TTFT per step, reuse and job completion time."""
    agent = suites.add_parser(
        "agent", help="concurrent agent sessions calling tools: TTFT per step, computed vs new prompt tokens, "
                      "job completion time",
        description="N agent sessions side by side, K steps each: steps 1..K-1 must call a tool (tool_choice "
                    "required), whose simulated result is appended before the next step; step K answers in text. "
                    "Without --url the bench starts each of --systems in turn (kvreuse serve, or llama-server "
                    "built by `make bench-peers`), afresh for every run.")
    agent.add_argument("--url", action="append", default=[], metavar="URL",
                       help="an OpenAI-compatible server already running (its root, with or without /v1); "
                            "repeatable; with --url, --systems defaults to none")
    agent.add_argument("--name", action="append", default=[], metavar="LABEL",
                       help="the label of each --url in order (default: server, server-2, ...)")
    agent.add_argument("--systems", nargs="*", metavar="SYSTEM",
                       help=f"servers to start, one after another: {', '.join(STARTED)} (default: "
                            f"{' '.join(DEFAULT_SYSTEMS)}, or none with --url)")
    agent.add_argument("--model", help=f"model of the started servers: {MODEL_HELP}")
    agent.add_argument("--block-size", type=positive_int, help="cache.block_size of the started servers")
    agent.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="a config key of the started servers; repeatable")
    agent.add_argument("--chat-template", metavar="FILE",
                       help="chat template of the started servers (default: the model's own; with llama-server, "
                            "examples/chatml-hermes-tools.jinja for both)")
    agent.add_argument("--llama-server", metavar="PATH",
                       help="the llama-server binary (default: on PATH, else beside this Python)")
    agent.add_argument("--repeats", type=positive_int, default=1,
                       help="runs of each system, interleaved (A B A B ...); medians reported (default 1)")
    agent.add_argument("--served-model", help="model name to send (default: the first of GET /v1/models)")
    agent.add_argument("--api-key", default="EMPTY", help="bearer token")
    agent.add_argument("--record", metavar="FILE",
                       help="write the transcript of the first run (the first system's, live) to FILE, for --replay")
    agent.add_argument("--replay", metavar="FILE",
                       help="replay a transcript written by --record on every system instead of the live loop: the "
                            "recorded messages step by step, tool_choice none, ignore_eos, max_tokens = the recorded "
                            "completion length; the workload flags are the recorded ones (report agent-replay.*)")
    _workload_flags(agent)
    out_flag(agent, "agent (agent-replay with --replay)", ", and the TTFT-per-step plot")
    log_level_flag(agent)
    agent.set_defaults(func=cmd_bench_agent)


def _workload_flags(agent: argparse.ArgumentParser) -> None:
    agent.add_argument("--sessions", type=positive_int, default=4, help="concurrent agent sessions (default 4)")
    agent.add_argument("--steps", type=positive_int, default=6,
                       help="steps per session, the last one the final answer (default 6)")
    agent.add_argument("--max-tokens", type=positive_int, default=96,
                       help="max_tokens of a tool-call step (default 96)")
    agent.add_argument("--answer-tokens", type=positive_int, default=64,
                       help="tokens of the final answer, sent with ignore_eos (default 64)")
    agent.add_argument("--tool-latency-s", type=float, default=0.5, help="simulated tool latency (default 0.5)")
    agent.add_argument("--tool-result-tokens", type=positive_int, default=150,
                       help="approximate size of each tool result (default 150)")
    agent.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    agent.add_argument("--session-hints", action="store_true",
                       help="each session's requests carry its prompt_cache_key (docs/features/sessions.md)")


def _systems(args: argparse.Namespace) -> list:
    from kvreuse.bench import agent_systems

    if len(args.name) > len(args.url):
        raise InputError("more --name labels than --url servers")
    names = args.systems if args.systems is not None else ([] if args.url else list(DEFAULT_SYSTEMS))
    shared = [*(("--model", args.model) if args.model else ()),
              *(("--block-size", str(args.block_size)) if args.block_size else ()),
              *(arg for item in args.overrides for arg in ("--set", item))]
    try:
        systems = agent_systems.started_systems(names, shared, sessions=args.sessions, model=args.model,
                                                chat_template=args.chat_template, llama_server=args.llama_server)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    labels = [*args.name, *(f"server-{i + 1}" if i else "server" for i in range(len(args.name), len(args.url)))]
    systems += [agent_systems.System(label, url=url) for label, url in zip(labels, args.url, strict=True)]
    if not systems:
        raise InputError("nothing to measure: give --url or --systems")
    if len({s.name for s in systems}) < len(systems):
        raise InputError("two systems share a name: label each --url with --name")
    return systems


def cmd_bench_agent(args: argparse.Namespace) -> int:
    """Run the agent loop against each system, print the tables; with --out also the report and the TTFT plot."""
    from kvreuse.bench import agent_bench, agent_report
    from kvreuse.bench.agent_loop import Options
    from kvreuse.bench.agent_replay import Transcript

    check_plots(args.out)
    if args.tool_latency_s < 0:
        raise InputError("--tool-latency-s must be >= 0")
    if args.record and args.replay:
        raise InputError("--record records a live run; --replay replays one: give one of them")
    try:
        replay = Transcript.load(args.replay) if args.replay else None
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    options = Options(sessions=args.sessions, steps=args.steps, call_tokens=args.max_tokens,
                                  answer_tokens=args.answer_tokens, tool_latency_s=args.tool_latency_s,
                                  tool_result_tokens=args.tool_result_tokens, seed=args.seed,
                                  session_hints=args.session_hints)
    transcript = Transcript(asdict(options)) if args.record else None
    try:
        report = agent_bench.run(_systems(args), options, model=args.served_model, api_key=args.api_key,
                                 progress=progress, repeats=args.repeats, transcript=transcript, replay=replay)
    except RuntimeError as exc:
        raise InputError(str(exc)) from exc
    if transcript is not None:
        progress(f"wrote the transcript of {transcript.source.get('system')}'s run to {transcript.save(args.record)}")
    name, png = ("agent-replay", agent_report.REPLAY_TTFT_PNG) if replay else ("agent", agent_report.TTFT_PNG)
    code = publish(name, report, agent_report.markdown(report), args.out)
    if args.out:
        progress(f"wrote {agent_report.ttft_plot(report, Path(args.out) / png)}")
    return code
