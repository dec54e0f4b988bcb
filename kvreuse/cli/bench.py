"""`kvreuse bench SUITE`: the bench command, and the suites that time the engine on synthetic prompts (engine,
prefix, tiers, eval, quant); the workload suites are in bench_workloads."""

from __future__ import annotations

import argparse

from kvreuse.cli.bench_workloads import add_cluster, add_replay, add_scenario
from kvreuse.cli.common import choices_of, log_level_flag, out_flag, positive_int, progress, publish, repeats_flag
from kvreuse.config import ModelConfig


def add_bench(sub) -> None:
    """The `bench` command and its suites, in the order `kvreuse bench --help` lists them."""
    bench = sub.add_parser("bench", help="benchmarks: scenarios in-process or against a server, engine and "
                                         "prefix suites", description="Benchmarks. Each subcommand prints a "
                                         "Markdown table; --out DIR also writes it and the JSON report.")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for add in (add_scenario, _add_engine, _add_prefix, _add_tiers, _add_eval, _add_quant, add_cluster, add_replay):
        add(suites)


def _dtype_flag(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    parser.add_argument("--dtype", choices=choices_of(ModelConfig, "dtype"), default=default, help=help)


def _add_engine(suites) -> None:
    engine = suites.add_parser("engine", help="cold prefill and decode vs HF transformers / llama.cpp, "
                                              "medians of interleaved rounds")
    repeats_flag(engine)
    engine.add_argument("--no-bf16", action="store_true", help="skip HF bf16 (slow without AVX512-BF16)")
    out_flag(engine, "engine")
    log_level_flag(engine)
    engine.set_defaults(func=cmd_bench_engine)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """Cold prefill and decode beside the peers."""
    from kvreuse.bench import engine_bench

    report = engine_bench.run(repeats=args.repeats, include_bf16=not args.no_bf16, progress=progress)
    return publish("engine", report, engine_bench.markdown(report), args.out)


def _add_prefix(suites) -> None:
    prefix = suites.add_parser("prefix", help="cold vs warm TTFT of a 2048-token prompt sharing 1984 tokens")
    repeats_flag(prefix)
    out_flag(prefix, "prefix")
    log_level_flag(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    """Cold against warm TTFT of a prompt sharing a long prefix."""
    from kvreuse.bench import prefix_bench

    report = prefix_bench.run(repeats=args.repeats, progress=progress)
    return publish("prefix", report, prefix_bench.markdown(report), args.out)


def _add_tiers(suites) -> None:
    tiers = suites.add_parser("tiers", help="TTFT of a prompt cold vs its prefix from memory, disk and Redis, "
                                            "interleaved rounds, with load bandwidth")
    repeats_flag(tiers)
    tiers.add_argument("--prompt-tokens", type=positive_int, default=2048, help="prompt length (default 2048)")
    _dtype_flag(tiers, "auto", "model.dtype (default auto: the machine's faster dtype)")
    tiers.add_argument("--redis-url", help="a Redis to measure (default: a redis-server started for the run)")
    tiers.add_argument("--disk-dir", help="where the disk tier's directory goes (default: the system's temp dir)")
    out_flag(tiers, "tiers")
    log_level_flag(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    """TTFT with the prefix loaded from each tier."""
    from kvreuse.bench import tiers_bench

    report = tiers_bench.run(repeats=args.repeats, redis_url=args.redis_url, dtype=args.dtype,
                             prompt_tokens=args.prompt_tokens, progress=progress, disk_dir=args.disk_dir)
    return publish("tiers", report, tiers_bench.markdown(report), args.out)


def _add_eval(suites) -> None:
    evaluation = suites.add_parser("eval", help="lm-eval's multiple choice (context + each answer, echo + "
                                                "logprobs) with caching on vs off vs HF transformers, interleaved")
    evaluation.add_argument("--questions", type=positive_int, default=16, help="questions (default 16)")
    evaluation.add_argument("--context-tokens", type=positive_int, default=400,
                            help="tokens of each question's context (default 400)")
    _dtype_flag(evaluation, "fp32", "model.dtype (default fp32)")
    evaluation.add_argument("--threads", type=positive_int, default=2, help="torch threads for the run (default 2)")
    repeats_flag(evaluation)
    out_flag(evaluation, "eval")
    log_level_flag(evaluation)
    evaluation.set_defaults(func=cmd_bench_eval)


def cmd_bench_eval(args: argparse.Namespace) -> int:
    """lm-eval style multiple choice with caching on and off."""
    from kvreuse.bench import eval_bench

    report = eval_bench.run(num_questions=args.questions, context_tokens=args.context_tokens, repeats=args.repeats,
                            dtype=args.dtype, threads=args.threads, progress=progress)
    return publish("eval", report, eval_bench.markdown(report), args.out)


def _add_quant(suites) -> None:
    quant = suites.add_parser("quant", help="weight-only quantization: decode and prefill speed beside fidelity to "
                                            "the unquantized model, interleaved rounds")
    quant.add_argument("--modes", nargs="+", choices=choices_of(ModelConfig, "quantization"),
                       default=choices_of(ModelConfig, "quantization"))
    _dtype_flag(quant, "fp32", "model.dtype (default fp32)")
    repeats_flag(quant)
    quant.add_argument("--prompts", type=positive_int, default=24, help="fidelity prompts (chat/rag/agent/eval)")
    quant.add_argument("--threads", type=positive_int, help="torch threads for the run (default: torch's)")
    out_flag(quant, "quant")
    log_level_flag(quant)
    quant.set_defaults(func=cmd_bench_quant)


def cmd_bench_quant(args: argparse.Namespace) -> int:
    """Speed and fidelity of each quantization mode."""
    from kvreuse.bench import quant_bench

    report = quant_bench.run(modes=args.modes, dtype=args.dtype, repeats=args.repeats, progress=progress,
                             num_prompts=args.prompts, threads=args.threads)
    return publish("quant", report, quant_bench.markdown(report), args.out)
