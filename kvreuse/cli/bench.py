"""`kvreuse bench SUITE`: the bench command, and the suites that time the engine on synthetic prompts (engine,
prefix, tiers, eval, quant); the workload suites are in bench_workloads."""

from __future__ import annotations

import argparse

from kvreuse.bench.engine_sizes import Sizes
from kvreuse.cli.bench_agent import add_agent
from kvreuse.cli.bench_kv_dtype import add_kv_dtype
from kvreuse.cli.bench_trace import add_scenario_trace, add_trace
from kvreuse.cli.bench_windows import add_windows
from kvreuse.cli.bench_workloads import add_cluster, add_replay, add_scenario
from kvreuse.cli.common import (
    MODEL_HELP,
    InputError,
    choices_of,
    log_level_flag,
    out_flag,
    positive_int,
    progress,
    publish,
    repeats_flag,
)
from kvreuse.config import CacheConfig, ModelConfig


def add_bench(sub) -> None:
    """The `bench` command and its suites, in the order `kvreuse bench --help` lists them."""
    bench = sub.add_parser("bench", help="benchmarks: scenarios in-process or against a server, engine and "
                                         "prefix suites", description="Benchmarks. Each subcommand prints a "
                                         "Markdown table; --out DIR also writes it and the JSON report.")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for add in (add_scenario, _add_engine, _add_prefix, _add_tiers, _add_eval, _add_quant, add_cluster, add_replay,
                add_trace, add_scenario_trace, add_windows, add_agent, add_kv_dtype):
        add(suites)


def _dtype_flag(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    parser.add_argument("--dtype", choices=choices_of(ModelConfig, "dtype"), default=default, help=help)


def _add_engine(suites) -> None:
    sizes = Sizes()
    engine = suites.add_parser("engine", help="cold prefill and decode vs HF transformers / llama.cpp, "
                                              "medians of interleaved rounds")
    repeats_flag(engine)
    engine.add_argument("--no-bf16", action="store_true", help="skip HF bf16 (slow without AVX512-BF16)")
    engine.add_argument("--model", help=MODEL_HELP)
    engine.add_argument("--device", choices=choices_of(ModelConfig, "device"), default="auto",
                        help="where every system runs (model.device; default auto: CUDA when present)")
    engine.add_argument("--systems", nargs="+", metavar="SYSTEM",
                        help="the rows to run, by name (kvreuse-bf16, hf-bf16, ...; default: what the model allows)")
    engine.add_argument("--prefill-lengths", nargs="+", type=positive_int, metavar="N", default=sizes.prefill_lengths,
                        help=_default("cold prefill lengths", sizes.prefill_lengths))
    engine.add_argument("--decode-batches", nargs="+", type=positive_int, metavar="B", default=sizes.decode_batches,
                        help=_default("decode batch sizes", sizes.decode_batches))
    engine.add_argument("--decode-tokens", type=positive_int, default=sizes.decode_tokens,
                        help=_default("tokens decoded per sequence, at least 2", sizes.decode_tokens))
    engine.add_argument("--decode-prompt-len", type=positive_int, default=sizes.decode_prompt_len,
                        help=_default("prompt tokens before decoding", sizes.decode_prompt_len))
    out_flag(engine, "engine")
    log_level_flag(engine)
    engine.set_defaults(func=cmd_bench_engine)


def _default(what: str, value: object) -> str:
    shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
    return f"{what} (default {shown})"


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """Cold prefill and decode beside the peers."""
    from kvreuse.bench import engine_bench

    unknown = [name for name in args.systems or () if name not in engine_bench.SYSTEMS]
    if unknown:
        raise InputError(f"unknown system {unknown[0]!r}; choose from {', '.join(engine_bench.SYSTEMS)}")
    if args.decode_tokens < 2:
        raise InputError("--decode-tokens must be at least 2: the first token is the prefill's")
    sizes = Sizes(tuple(args.prefill_lengths), args.decode_prompt_len, args.decode_tokens, tuple(args.decode_batches))
    try:
        report = engine_bench.run(repeats=args.repeats, include_bf16=not args.no_bf16, progress=progress,
                                  target=engine_bench.Target(args.model, args.device, sizes), systems=args.systems)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    return publish("engine", report, engine_bench.markdown(report), args.out)


def _add_prefix(suites) -> None:
    prefix = suites.add_parser("prefix", help="cold vs warm TTFT of a 2048-token prompt sharing 1984 tokens")
    repeats_flag(prefix)
    prefix.add_argument("--model", help=MODEL_HELP)
    prefix.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key (cache.sliding_kv=full, say); repeatable")
    out_flag(prefix, "prefix")
    log_level_flag(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    """Cold against warm TTFT of a prompt sharing a long prefix."""
    from kvreuse.bench import prefix_bench

    report = prefix_bench.run(repeats=args.repeats, progress=progress, model=args.model, sets=args.set)
    return publish("prefix", report, prefix_bench.markdown(report), args.out)


def _add_tiers(suites) -> None:
    tiers = suites.add_parser("tiers", help="TTFT of a prompt cold vs its prefix from memory, disk and Redis, "
                                            "interleaved rounds, with load bandwidth")
    repeats_flag(tiers)
    tiers.add_argument("--prompt-tokens", type=positive_int, default=2048, help="prompt length (default 2048)")
    _dtype_flag(tiers, "auto", "model.dtype (default auto: the machine's faster dtype)")
    tiers.add_argument("--kv-cache-dtype", choices=choices_of(CacheConfig, "kv_dtype"), default="auto",
                       help="cache.kv_dtype: how the pool and the tiers hold K/V (default auto: the model dtype)")
    tiers.add_argument("--redis-url", help="a Redis to measure (default: a redis-server started for the run)")
    tiers.add_argument("--disk-dir", help="where the disk tier's directory goes (default: the system's temp dir)")
    out_flag(tiers, "tiers")
    log_level_flag(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    """TTFT with the prefix loaded from each tier."""
    from kvreuse.bench import tiers_bench

    report = tiers_bench.run(repeats=args.repeats, redis_url=args.redis_url, dtype=args.dtype,
                             prompt_tokens=args.prompt_tokens, progress=progress, disk_dir=args.disk_dir,
                             kv_dtype=args.kv_cache_dtype)
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
