"""Command line: `kvreuse generate`, `serve`, `bench scenario|engine|prefix|tiers|eval|quant|cluster|replay`,
`fidelity`, `analyze`, `cache warm|stats|clear`, `tokenizer export`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from kvreuse.bench.workloads import WORKLOADS
from kvreuse.config import PRESETS, Config, ConfigError, load_config
from kvreuse.model.loader import ModelLoadError
from kvreuse.prompts_file import PromptRecord, PromptsFileError, read_prompts_file

EXIT_USAGE = 2

# The vLLM-style shorthand flags, by argparse dest, and the config key each sets. Each command has some of them.
SHORTHANDS = {
    "model": "model.path",
    "device": "model.device",
    "dtype": "model.dtype",
    "quantization": "model.quantization",
    "block_size": "cache.block_size",
    "max_model_len": "server.max_tokens",
    "enable_prefix_caching": "cache.enabled",
    "preset": "cache.preset",
    "host": "server.host",
    "port": "server.port",
    "api_keys": "server.api_keys_file",
    "replicas": "cluster.replicas",
    "ray_address": "cluster.ray_address",
}


class InputError(ValueError):
    pass


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The --set assignments, then the shorthand flags given, so a flag wins over --set for the same key."""
    given = ((key, getattr(args, dest, None)) for dest, key in SHORTHANDS.items())
    return [*args.overrides, *(f"{key}={value}" for key, value in given if value is not None)]


def build_config(args: argparse.Namespace) -> Config:
    """Shorthand flags > --set > the --config file > defaults."""
    return load_config(args.config, config_overrides(args))


def _shorthand(dest: str) -> str:
    return f"shorthand for --set {SHORTHANDS[dest]}="


def _log_level_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO (per-request cache-hit log), WARNING")


def _common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="INI config file (the seed's [server]/[cache] keys and more)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable; wins over the file")
    parser.add_argument("--model", help="a Llama-family .gguf file or Hugging Face directory (default: embedded)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help=_shorthand("device"))
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help=_shorthand("dtype"))
    parser.add_argument("--quantization", choices=["none", "int8", "int4"],
                        help=f"weight-only, approximate ({_shorthand('quantization')})")
    parser.add_argument("--block-size", type=int, help=_shorthand("block_size"))
    parser.add_argument("--preset", choices=list(PRESETS),
                        help=f"scenario preset ({_shorthand('preset')}); explicit keys override it")
    parser.add_argument("--max-model-len", type=int, help=f"{_shorthand('max_model_len')} (context limit)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help=_shorthand("enable_prefix_caching"))
    _log_level_flag(parser)


def _positive_int(text: str) -> int:
    problem = argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    try:
        value = int(text)
    except ValueError:
        raise problem from None
    if value < 1:
        raise problem
    return value


def _scenario_name(text: str) -> str:
    # A type check, not `choices`: argparse (3.11) rejects an empty nargs="*" list against choices.
    if text not in (*WORKLOADS, "all"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join([*WORKLOADS, 'all'])})")
    return text


def _chosen_scenarios(names: list[str]) -> list[str]:
    return list(WORKLOADS) if not names or "all" in names else list(dict.fromkeys(names))


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _argument_prompts(prompts: list[str], chat: bool) -> list[PromptRecord]:
    if chat:
        return [PromptRecord(line=i, messages=[{"role": "user", "content": p}]) for i, p in enumerate(prompts, 1)]
    return [PromptRecord(line=i, prompt=p) for i, p in enumerate(prompts, 1)]


def cmd_generate(args: argparse.Namespace) -> int:
    from kvreuse.engine.engine import RequestError
    from kvreuse.llm import LLM
    from kvreuse.sampling_params import SamplingParams

    config = build_config(args)
    requests = read_prompts_file(args.input) if args.input else _argument_prompts(args.prompts, args.chat)
    if not requests:
        raise InputError("nothing to generate: give prompts as arguments or --input FILE.jsonl")

    llm = LLM(config)
    default_max = args.max_tokens or config.server.default_max_tokens
    prompts, params = [], []
    for r in requests:
        where = f"{args.input}, line {r.line}" if args.input else f"prompt {r.line}"
        try:
            p = SamplingParams(max_tokens=default_max if r.max_tokens is None else r.max_tokens,
                               temperature=args.temperature if r.temperature is None else r.temperature,
                               seed=args.seed)
            prompt = llm.engine.tokenize_chat(r.messages) if r.messages is not None else r.prompt
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from exc
        prompts.append(prompt)
        params.append(p)

    def emit(out) -> None:
        if args.json:
            print(json.dumps(out.to_json(), ensure_ascii=False), flush=True)
        else:
            print(out.text, flush=True)
            u = out.usage
            print(f"[{out.request_id}] prompt={u.prompt_tokens} cached={u.cached_tokens} "
                  f"completion={u.completion_tokens} finish={out.finish_reason} ttft={out.ttft_s * 1000:.0f}ms "
                  f"total={out.total_s:.2f}s", file=sys.stderr, flush=True)

    try:
        if args.batch:
            for out in llm.generate(prompts, params):
                emit(out)
        else:
            # In input order, each after the previous one, so later requests can reuse earlier KV.
            for prompt, p in zip(prompts, params, strict=True):
                emit(llm.generate(prompt, p)[0])
    except RequestError as exc:
        raise InputError(str(exc)) from exc
    s = llm.engine.stats_snapshot()
    print(f"[summary] requests={s['num_requests']} hit_rate={s['hit_rate']:.3f} prompt={s['prompt_tokens']} "
          f"cached={s['cached_tokens']} computed={s['computed_prompt_tokens']} evictions={s['evictions']} "
          f"({s['eviction_policy']}) peak_kv_in_use={s['peak_kv_bytes_in_use'] / 2**20:.1f}MiB "
          f"peak_rss={s['peak_rss_bytes'] / 2**20:.0f}MiB", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    config = build_config(args)
    if config.cluster.replicas > 1:
        from kvreuse.cluster.launch import ClusterStartError, serve_cluster

        try:
            return serve_cluster(config, served_model_name=args.served_model_name, log_level=args.log_level)
        except ClusterStartError as exc:
            print(f"kvreuse: {exc}", file=sys.stderr)
            return 1
    from kvreuse.server.lifecycle import serve

    return serve(config, served_model_name=args.served_model_name, log_level=args.log_level)


def _publish(name: str, report: dict, table: str, out: str | None) -> int:
    from kvreuse.bench.commands import write_report

    print(table)
    if out:
        write_report(Path(out), name, report, table)
    return 0


def cmd_bench_scenario(args: argparse.Namespace) -> int:
    from kvreuse.bench import commands, scenario_bench

    scenarios = _chosen_scenarios(args.scenarios)
    num_requests = args.requests or (4 if args.quick else 24)
    max_tokens = args.max_tokens or (4 if args.quick else 16)
    overrides = config_overrides(args)
    configs = {s: commands.scenario_config(s, args.config, overrides) for s in scenarios}
    report = scenario_bench.run(configs, num_requests, max_tokens, args.concurrency, peers=not args.no_peers,
                                progress=_progress)
    table = scenario_bench.markdown(report)
    print(table)
    if args.out:
        commands.write_scenario_plots(Path(args.out), report, scenarios, num_requests,
                                      commands.scenario_config("none", args.config, overrides))
        commands.write_report(Path(args.out), "scenario", report, table)
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from kvreuse.bench import engine_bench

    report = engine_bench.run(repeats=args.repeats, include_bf16=not args.no_bf16, progress=_progress)
    return _publish("engine", report, engine_bench.markdown(report), args.out)


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    from kvreuse.bench import prefix_bench

    report = prefix_bench.run(repeats=args.repeats, progress=_progress)
    return _publish("prefix", report, prefix_bench.markdown(report), args.out)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from kvreuse.bench import tiers_bench

    report = tiers_bench.run(repeats=args.repeats, redis_url=args.redis_url, dtype=args.dtype,
                             prompt_tokens=args.prompt_tokens, progress=_progress, disk_dir=args.disk_dir)
    return _publish("tiers", report, tiers_bench.markdown(report), args.out)


def cmd_bench_eval(args: argparse.Namespace) -> int:
    from kvreuse.bench import eval_bench

    report = eval_bench.run(num_questions=args.questions, context_tokens=args.context_tokens, repeats=args.repeats,
                            dtype=args.dtype, threads=args.threads, progress=_progress)
    return _publish("eval", report, eval_bench.markdown(report), args.out)


def cmd_bench_quant(args: argparse.Namespace) -> int:
    from kvreuse.bench import quant_bench

    report = quant_bench.run(modes=args.modes, dtype=args.dtype, repeats=args.repeats, progress=_progress,
                             num_prompts=args.prompts, threads=args.threads)
    return _publish("quant", report, quant_bench.markdown(report), args.out)


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from kvreuse.bench import cluster_bench

    server_args = tuple(arg for item in args.overrides for arg in ("--set", item))
    try:
        report = cluster_bench.run(args.replicas, args.requests, args.turns, args.max_tokens, server_args,
                                   progress=_progress)
    except RuntimeError as exc:
        raise InputError(str(exc)) from exc
    return _publish("cluster", report, cluster_bench.markdown(report), args.out)


def cmd_bench_replay(args: argparse.Namespace) -> int:
    from kvreuse.bench import replay

    try:
        report = replay.run_scenarios(args.url, _chosen_scenarios(args.scenarios), args.requests, args.max_tokens,
                                      model=args.served_model, concurrency=args.concurrency,
                                      request_rate=args.request_rate, api_key=args.api_key, sessions=args.sessions,
                                      turns=args.turns)
    except (RuntimeError, ValueError) as exc:
        raise InputError(str(exc)) from exc
    return _publish("replay", report, replay.markdown(report), args.out)


def cmd_fidelity(args: argparse.Namespace) -> int:
    from kvreuse.bench import fidelity

    report = fidelity.fidelity_report(num_requests=args.requests, seed=args.seed, modes=args.modes,
                                      overrides=config_overrides(args), progress=_progress,
                                      continuation=args.continuation, workload=args.workload,
                                      config_file=args.config)
    print(json.dumps(report, indent=2) if args.json else fidelity.markdown(report))
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from kvreuse.analyze import analyze, text_report

    config = build_config(args)
    records = read_prompts_file(args.prompts_file)
    if not records:
        raise InputError(f"{args.prompts_file}: no prompts")
    report = analyze([r.text_or_messages for r in records], config)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else text_report(report))
    return 0


# --- cache: the lower tiers (disk, Redis) from outside a server --------------------------------------------------
NO_TIER = "no lower KV tier is configured (cache.disk.path, cache.redis.url)"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def cmd_cache_warm(args: argparse.Namespace) -> int:
    from kvreuse.engine.engine import RequestError
    from kvreuse.llm import LLM
    from kvreuse.warm import WarmError, warm

    config = build_config(args)
    if not (config.cache.disk.path or config.cache.redis.url):
        raise InputError(f"{NO_TIER}: warming a process that then exits would be pointless; set "
                         "--set cache.disk.path=DIR and/or --set cache.redis.url=redis://HOST:PORT/DB")
    if not config.cache.enabled:
        raise InputError("cache.enabled is false: nothing would be cached or written to the lower tiers")
    records = read_prompts_file(args.file)
    if not records:
        raise InputError(f"{args.file}: no prompts")

    llm = LLM(config)
    try:
        summary = warm(llm, records, cache_salt=args.cache_salt)
    except WarmError as exc:
        raise InputError(f"{args.file}, {exc}") from exc
    except RequestError as exc:
        raise InputError(str(exc)) from exc
    finally:
        llm.engine.close()

    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        by_tier = summary["cached_tokens_details"]
        written = ", ".join(f"{name} {n}" for name, n in summary["blocks_written"].items())
        reused = f", {summary['reused_tokens']} reused" if summary["reused_tokens"] else ""
        print(f"warmed {summary['num_items']} prompts ({summary['prompt_tokens']} prompt tokens) in "
              f"{summary['seconds']:.2f}s: {summary['cached_tokens']} tokens were already cached (memory "
              f"{by_tier['memory']}, disk {by_tier['disk']}, redis {by_tier['redis']}){reused}, "
              f"{summary['computed_prompt_tokens']} computed; blocks written: {written}; "
              f"{summary['dropped_blocks']} dropped by a full write queue.")
    for item in summary["failed"]:
        print(f"kvreuse: {args.file}, line {item['line']}: {item['error']}", file=sys.stderr)
    if not summary["flushed"]:
        print("kvreuse: the lower tiers did not finish writing in time; some blocks may be missing",
              file=sys.stderr)
    return 0 if summary["flushed"] and not summary["failed"] else 1


def cmd_cache_stats(args: argparse.Namespace) -> int:
    from kvreuse.kvcache.tiers.store import build_tiers

    tiers = build_tiers(build_config(args).cache)
    try:
        usage = [t.usage() for t in tiers]
    finally:
        for tier in tiers:
            tier.close()
    if args.json:
        print(json.dumps({"tiers": [u.__dict__ for u in usage]}))
        return 0
    if not usage:
        print(NO_TIER)
    for u in usage:
        entries = "? entries" if u.num_entries is None else f"{u.num_entries} entries"
        size = "size unknown" if u.num_bytes is None else _mib(u.num_bytes)
        capacity = "no limit of ours" if u.capacity_bytes is None else f"capacity {_mib(u.capacity_bytes)}"
        print(f"{u.name}  {u.detail}  {entries}  {size}  {capacity}  "
              f"{'available' if u.available else 'UNAVAILABLE'}")
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    from kvreuse.kvcache.tiers.store import build_tiers

    tiers = build_tiers(build_config(args).cache)
    try:
        cleared = [(t.name, t.usage().detail, t.clear()) for t in tiers]
    finally:
        for tier in tiers:
            tier.close()
    if args.json:
        print(json.dumps({"cleared": {name: n for name, _, n in cleared}}))
        return 0
    if not cleared:
        print(NO_TIER)
    for name, detail, n in cleared:
        print(f"{name}  {detail}  {n} entries removed")
    return 0


# --- tokenizer: the served tokenizer as a Hugging Face directory, for clients that want one -------------------------
def cmd_tokenizer_export(args: argparse.Namespace) -> int:
    from kvreuse.model.loader import load_model_info
    from kvreuse.model.tokenizer import Tokenizer

    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise InputError(f"{out} is not empty: choose an empty or new directory, or pass --force to overwrite the "
                         "tokenizer files in it")
    info = load_model_info(args.model)  # metadata only: no weights are loaded
    # The context limit `kvreuse serve` would report, so that clients truncate where the server does.
    server = load_config(None, [f"server.max_tokens={args.max_model_len}"] if args.max_model_len else []).server
    max_model_len = min(server.max_tokens, info.args.max_position_embeddings)
    written = Tokenizer.load(info.path, info.fingerprint).export(out, max_model_len)
    print(f"wrote {', '.join(p.name for p in written)} to {out} (model_max_length {max_model_len}); load it with "
          f"transformers.AutoTokenizer.from_pretrained({str(out)!r})")
    return 0


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate completions offline")
    _common_flags(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (plain text; with --chat, user messages)")
    gen.add_argument("--input", help='JSONL file: {"prompt": ...} or {"messages": [...]} per line')
    gen.add_argument("--chat", action="store_true", help="wrap argument prompts in the model's chat template")
    gen.add_argument("--max-tokens", type=int, help="completion tokens per request (default server.default_max_tokens)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, help="sampling seed")
    gen.add_argument("--json", action="store_true", help="one JSON object per request per line")
    gen.add_argument("--batch", action="store_true", help="submit all requests at once (continuous batching)")
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _common_flags(serve)
    serve.add_argument("--host", help=f"{_shorthand('host')} (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help=f"{_shorthand('port')} (default 8000; 0 = any free port)")
    serve.add_argument("--api-keys", help=f"file of API keys -> tenants ({_shorthand('api_keys')})")
    serve.add_argument("--served-model-name", help="model id clients use (default: the weights file name)")
    serve.add_argument("--replicas", type=_positive_int,
                       help=f"engine replicas on Ray Serve behind one endpoint ({_shorthand('replicas')}; default 1: "
                            f"no Ray)")
    serve.add_argument("--ray-address", help=f"a Ray cluster to join ({_shorthand('ray_address')}; default: start "
                                             f"one for the server's lifetime)")
    serve.set_defaults(func=cmd_serve)


def _scenario_names(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenarios", nargs="*", type=_scenario_name, metavar="SCENARIO",
                        help=f"{', '.join(WORKLOADS)} or all (default: all; prefix is SGLang's "
                             "generated-shared-prefix)")


def _repeats_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=_positive_int, default=3, help="measured rounds (after one warm-up round)")


def _out_flag(parser: argparse.ArgumentParser, name: str, extra: str = "") -> None:
    parser.add_argument("--out", metavar="DIR", help=f"directory for {name}.json and {name}.md{extra}")


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: scenarios in-process or against a server, engine and "
                                         "prefix suites", description="Benchmarks. Each subcommand prints a "
                                         "Markdown table; --out DIR also writes it and the JSON report.")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")

    scenario = suites.add_parser("scenario", help="the seed's scenarios in-process, in modes no-cache, prefix, "
                                                  "shift, blend, beside HF transformers",
                                 description="The seed's scenarios in modes no-cache, prefix, shift, blend, each "
                                             "under its own preset unless --preset is given, beside HF "
                                             "transformers on the same weights; fidelity against no-cache.")
    _common_flags(scenario)
    _scenario_names(scenario)
    scenario.add_argument("--quick", action="store_true", help="4 requests x 4 tokens (a smoke run)")
    scenario.add_argument("--requests", type=_positive_int, help="requests per scenario (default 24; --quick: 4)")
    scenario.add_argument("--max-tokens", type=_positive_int,
                          help="completion tokens per request (default 16; --quick: 4)")
    scenario.add_argument("--concurrency", type=_positive_int,
                          help="requests in flight (default: each scenario's own; eval is a batch job)")
    scenario.add_argument("--no-peers", action="store_true", help="skip the HF transformers peers")
    _out_flag(scenario, "scenario", ", and PNG plots (TTFT per mode, hit rate against block_size)")
    scenario.set_defaults(func=cmd_bench_scenario)

    engine = suites.add_parser("engine", help="cold prefill and decode vs HF transformers / llama.cpp, "
                                              "medians of interleaved rounds")
    _repeats_flag(engine)
    engine.add_argument("--no-bf16", action="store_true", help="skip HF bf16 (slow without AVX512-BF16)")
    _out_flag(engine, "engine")
    _log_level_flag(engine)
    engine.set_defaults(func=cmd_bench_engine)

    prefix = suites.add_parser("prefix", help="cold vs warm TTFT of a 2048-token prompt sharing 1984 tokens")
    _repeats_flag(prefix)
    _out_flag(prefix, "prefix")
    _log_level_flag(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)

    tiers = suites.add_parser("tiers", help="TTFT of a prompt cold vs its prefix from memory, disk and Redis, "
                                            "interleaved rounds, with load bandwidth")
    _repeats_flag(tiers)
    tiers.add_argument("--prompt-tokens", type=_positive_int, default=2048, help="prompt length (default 2048)")
    tiers.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                       help="model.dtype (default auto: the machine's faster dtype)")
    tiers.add_argument("--redis-url", help="a Redis to measure (default: a redis-server started for the run)")
    tiers.add_argument("--disk-dir", help="where the disk tier's directory goes (default: the system's temp dir)")
    _out_flag(tiers, "tiers")
    _log_level_flag(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)

    evaluation = suites.add_parser("eval", help="lm-eval's multiple choice (context + each answer, echo + "
                                                "logprobs) with caching on vs off vs HF transformers, interleaved")
    evaluation.add_argument("--questions", type=_positive_int, default=16, help="questions (default 16)")
    evaluation.add_argument("--context-tokens", type=_positive_int, default=400,
                            help="tokens of each question's context (default 400)")
    evaluation.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="fp32",
                            help="model.dtype (default fp32)")
    evaluation.add_argument("--threads", type=_positive_int, default=2, help="torch threads for the run (default 2)")
    _repeats_flag(evaluation)
    _out_flag(evaluation, "eval")
    _log_level_flag(evaluation)
    evaluation.set_defaults(func=cmd_bench_eval)

    quant = suites.add_parser("quant", help="weight-only quantization: decode and prefill speed beside fidelity to "
                                            "the unquantized model, interleaved rounds")
    quant.add_argument("--modes", nargs="+", choices=["none", "int8", "int4"], default=["none", "int8", "int4"])
    quant.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="fp32", help="model.dtype (default fp32)")
    _repeats_flag(quant)
    quant.add_argument("--prompts", type=_positive_int, default=24, help="fidelity prompts (chat/rag/agent/eval)")
    quant.add_argument("--threads", type=_positive_int, help="torch threads for the run (default: torch's)")
    _out_flag(quant, "quant")
    _log_level_flag(quant)
    quant.set_defaults(func=cmd_bench_quant)

    cluster = suites.add_parser("cluster", help="chat and agent sessions against one server and against "
                                                "--replicas N under each routing policy, one at a time")
    cluster.add_argument("--replicas", type=_positive_int, default=2, help="replicas (default 2)")
    cluster.add_argument("--requests", type=_positive_int, default=24, help="requests per scenario (default 24)")
    cluster.add_argument("--turns", type=_positive_int, default=4, help="turns per chat session (default 4)")
    cluster.add_argument("--max-tokens", type=_positive_int, default=16, help="completion tokens (default 16)")
    cluster.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                         help="a config key for every server started; repeatable")
    _out_flag(cluster, "cluster")
    _log_level_flag(cluster)
    cluster.set_defaults(func=cmd_bench_cluster)

    replay = suites.add_parser("replay", help="the scenarios replayed against an OpenAI-compatible server",
                               description="The scenarios replayed over HTTP, streaming, against any "
                                           "OpenAI-compatible server (ours, vLLM, llama.cpp); keys as "
                                           "`vllm bench serve` names them.")
    replay.add_argument("url", metavar="URL", help="the server's root URL (with or without /v1)")
    _scenario_names(replay)
    replay.add_argument("--requests", type=_positive_int, default=24, help="requests per scenario (default 24)")
    replay.add_argument("--max-tokens", type=_positive_int, default=16,
                        help="completion tokens per request (default 16)")
    replay.add_argument("--concurrency", type=_positive_int, help="requests in flight (default: no cap)")
    replay.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second (default inf: all at once)")
    replay.add_argument("--served-model", help="model name to send (default: the first of GET /v1/models)")
    replay.add_argument("--api-key", default="EMPTY", help="bearer token")
    replay.add_argument("--sessions", action="store_true",
                        help="send each chat session's turns in order (each after the previous reply), the sessions "
                             "side by side, as vLLM's multi-turn benchmark clients do")
    replay.add_argument("--turns", type=_positive_int, help="turns per chat session (default 8)")
    _out_flag(replay, "replay")
    _log_level_flag(replay)
    replay.set_defaults(func=cmd_bench_replay)


def _add_fidelity(sub) -> None:
    fid = sub.add_parser("fidelity", help="segment reuse against exact recompute on a built-in workload")
    # --config sits under fidelity's own settings (fp32, 4096-token context, segment reuse on); --set and the
    # shorthand flags win over both.
    _common_flags(fid)
    fid.add_argument("--requests", type=int, default=24, help="requests (default 24)")
    fid.add_argument("--seed", type=int, default=0, help="workload seed")
    fid.add_argument("--workload", choices=list(WORKLOADS), default="rag",
                     help="rag: 2-3 documents per query in varying order; eval: varying answer + fixed rubric; "
                          "chat: multi-turn follow-ups; agent: variable tool results + fixed tool rules; "
                          "prefix: groups sharing a long system prompt")
    fid.add_argument("--modes", nargs="+", choices=["prefix-only", "shift-noguard", "shift", "blend-noguard",
                                                    "blend", "blend-1.0"], help="default: all")
    fid.add_argument("--continuation", type=int, default=32, help="greedy tokens compared per request")
    fid.add_argument("--json", action="store_true", help="the whole report as JSON")
    fid.set_defaults(func=cmd_fidelity)


def _add_analyze(sub) -> None:
    ana = sub.add_parser("analyze", help="why is the hit rate low? diagnose a prompt log without running the model")
    _common_flags(ana)
    ana.add_argument("prompts_file", help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    ana.add_argument("--json", action="store_true", help="the report as JSON")
    ana.set_defaults(func=cmd_analyze)


def _add_cache(sub) -> None:
    cache = sub.add_parser("cache", help="the lower KV tiers (disk, Redis): warm, stats, clear",
                           description="The lower KV tiers that [cache] configures (cache.disk.path, "
                                       "cache.redis.url), from outside a server.")
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")

    warm = actions.add_parser("warm", help="compute the KV of a prompt file and write it to the lower tiers")
    _common_flags(warm)
    warm.add_argument("file", metavar="FILE.jsonl", help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    warm.add_argument("--cache-salt", help="the salt the requests to serve will carry (KV is shared only within it)")
    warm.add_argument("--json", action="store_true", help="the summary as JSON")
    warm.set_defaults(func=cmd_cache_warm)

    stats = actions.add_parser("stats", help="what each lower tier holds (without loading the model)")
    _common_flags(stats)
    stats.add_argument("--json", action="store_true", help="the tiers as JSON")
    stats.set_defaults(func=cmd_cache_stats)

    clear = actions.add_parser("clear", help="remove every entry of every lower tier (Redis: only ours)")
    _common_flags(clear)
    clear.add_argument("--json", action="store_true", help="the counts as JSON")
    clear.set_defaults(func=cmd_cache_clear)


def _add_tokenizer(sub) -> None:
    tok = sub.add_parser("tokenizer", help="the model's tokenizer for other tools")
    actions = tok.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser("export", help="write the tokenizer as a Hugging Face directory (tokenizer.json, "
                                               "tokenizer_config.json with the chat template, special_tokens_map.json)"
                                               " without loading the weights")
    export.add_argument("dir", metavar="DIR", help="output directory: new or empty (or see --force)")
    export.add_argument("--model", help="a Llama-family .gguf file or Hugging Face directory (default: embedded)")
    export.add_argument("--max-model-len", type=_positive_int,
                        help="model_max_length to write (default: the context limit `kvreuse serve` uses)")
    export.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    _log_level_flag(export)
    export.set_defaults(func=cmd_tokenizer_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvreuse", description="LLM inference built around KV-cache reuse")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_serve, _add_bench, _add_fidelity, _add_analyze, _add_cache, _add_tokenizer):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvreuse: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (InputError, PromptsFileError) as exc:
        print(f"kvreuse: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelLoadError as exc:
        print(f"kvreuse: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
