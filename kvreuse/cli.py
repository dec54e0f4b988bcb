"""Command line: `kvreuse generate` (and, as they land, serve / bench / analyze)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from kvreuse.bench.workloads import WORKLOADS
from kvreuse.config import PRESETS, Config, ConfigError, load_config
from kvreuse.model.loader import ModelLoadError

EXIT_USAGE = 2


class InputError(ValueError):
    pass


def _common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="INI config file (the seed's [server]/[cache] keys and more)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable; wins over the file")
    parser.add_argument("--model", help="a Llama-family .gguf file or Hugging Face directory (default: embedded)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="shorthand for --set model.device=")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help="shorthand for --set model.dtype=")
    parser.add_argument("--block-size", type=int, help="shorthand for --set cache.block_size=")
    parser.add_argument("--preset", choices=list(PRESETS),
                        help="scenario preset (shorthand for --set cache.preset=); explicit keys override it")
    parser.add_argument("--max-model-len", type=int, help="shorthand for --set server.max_tokens= (context limit)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="shorthand for --set cache.enabled=")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO (per-request cache-hit log), WARNING")


def build_overrides(args: argparse.Namespace) -> list[str]:
    """--set assignments, then the shorthand flags (which win)."""
    shorthands = {"model.path": args.model, "model.device": args.device, "model.dtype": args.dtype,
                  "cache.block_size": args.block_size, "server.max_tokens": args.max_model_len,
                  "cache.enabled": args.enable_prefix_caching, "cache.preset": args.preset}
    return list(args.overrides) + [f"{k}={v}" for k, v in shorthands.items() if v is not None]


def build_config(args: argparse.Namespace) -> Config:
    """CLI flags > --set > config file > defaults."""
    return load_config(args.config, build_overrides(args))


def read_requests(path: str) -> list[dict]:
    """JSONL lines of {"prompt": str} or {"messages": [...]}, with optional max_tokens and temperature."""
    requests = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read --input {path}: {exc.strerror}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}, line {number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise InputError(f'{path}, line {number}: expected an object with exactly one of "prompt" or "messages"')
        if "prompt" in record and not (isinstance(record["prompt"], str) and record["prompt"]):
            raise InputError(f'{path}, line {number}: "prompt" must be a non-empty string')
        if "messages" in record and not _valid_messages(record["messages"]):
            raise InputError(f'{path}, line {number}: "messages" must be a non-empty list of '
                             '{"role": str, "content": str} objects')
        unknown = set(record) - {"prompt", "messages", "max_tokens", "temperature"}
        if unknown:
            raise InputError(f"{path}, line {number}: unknown field(s) {', '.join(sorted(unknown))}; "
                             "allowed: prompt, messages, max_tokens, temperature")
        record["line"] = number
        requests.append(record)
    return requests


def _valid_messages(messages) -> bool:
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages))


def cmd_generate(args: argparse.Namespace) -> int:
    from kvreuse.engine.engine import RequestError
    from kvreuse.llm import LLM
    from kvreuse.sampling_params import SamplingParams

    config = build_config(args)
    if args.input:
        requests = read_requests(args.input)
    else:
        key = "messages" if args.chat else "prompt"
        requests = [{key: [{"role": "user", "content": p}] if args.chat else p, "line": i}
                    for i, p in enumerate(args.prompts, start=1)]
    if not requests:
        raise InputError("nothing to generate: give prompts as arguments or --input FILE.jsonl")

    llm = LLM(config)
    default_max = args.max_tokens or config.server.default_max_tokens
    prompts, params = [], []
    for r in requests:
        where = f"{args.input}, line {r['line']}" if args.input else f"prompt {r['line']}"
        try:
            p = SamplingParams(max_tokens=r.get("max_tokens", default_max),
                               temperature=r.get("temperature", args.temperature), seed=args.seed)
            prompt = llm.engine.render_chat(r["messages"]) if "messages" in r else r["prompt"]
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
    import signal

    import uvicorn

    from kvreuse.engine.engine import LLMEngine
    from kvreuse.sampling_params import SamplingParams
    from kvreuse.server.api_keys import load_api_keys
    from kvreuse.server.app import create_app

    for flag, key in ((args.host, "server.host"), (args.port, "server.port"), (args.api_keys, "server.api_keys_file")):
        if flag is not None:
            args.overrides.append(f"{key}={flag}")
    config = build_config(args)
    api_keys = load_api_keys(config.server.api_keys_file) if config.server.api_keys_file else None
    engine = LLMEngine(config)
    engine.add_request("warm up", SamplingParams(max_tokens=2), use_cache=False)
    while engine.has_unfinished():
        engine.step()
    # "SmolLM2-135M-Instruct.Q4_1.gguf" is served as "SmolLM2-135M-Instruct".
    model_name = args.served_model_name or re.sub(r"(\.(Q\d\w*|F16|F32|BF16))?\.gguf$", "", engine.model_path.name)
    app = create_app(engine, model_name, api_keys)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"kvreuse ready: http://{host}:{port}/v1 model={model_name} max_model_len={engine.max_model_len} "
                      f"kv_capacity={engine.kv_capacity_tokens} tokens ({engine.num_kv_blocks} blocks x "
                      f"{engine.block_size}) prefix_caching={'on' if config.cache.enabled else 'off'} "
                      f"auth={'api-keys' if api_keys else 'off'}", flush=True)

        def handle_exit(self, sig, frame):
            app.state.kvreuse.draining = True  # new requests get 503 while in-flight ones finish
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                   log_level=args.log_level.lower(),
                                   timeout_graceful_shutdown=config.server.drain_timeout_s))
    # uvicorn re-raises the signal that stopped it once it has drained; a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    progress = lambda line: print(line, file=sys.stderr, flush=True)
    if args.concurrency is not None and args.concurrency < 1:
        raise InputError(f"--concurrency must be >= 1, got {args.concurrency}")
    scenarios = list(WORKLOADS) if args.scenario in (None, "all") else [args.scenario]
    num_requests = args.requests or (4 if args.quick else 24)
    max_tokens = args.max_tokens or (4 if args.quick else 16)
    if args.url:
        from kvreuse.bench import replay as suite

        name, report = "replay", bench_url(args, scenarios, num_requests, max_tokens)
    elif args.scenario:
        from kvreuse.bench import scenario_bench as suite

        name = "scenario"
        report = suite.run({s: scenario_config(args, s) for s in scenarios}, num_requests, max_tokens,
                           args.concurrency, peers=not args.no_peers, progress=progress)
    else:
        name = args.suite
        suite = importlib.import_module(f"kvreuse.bench.{name}_bench")
        kwargs = {"include_bf16": not args.no_bf16} if args.suite == "engine" else {}
        report = suite.run(repeats=args.repeats, progress=progress, **kwargs)
    table = suite.markdown(report)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if name == "scenario":
            from kvreuse.bench import plots

            report["block_size_sweep"] = plots.block_size_sweep(scenarios, list(plots.DEFAULT_BLOCK_SIZES),
                                                                num_requests, scenario_config(args, "none"))
            for path in plots.write_plots(report, report["block_size_sweep"], out):
                print(f"wrote {path}", file=sys.stderr)
        (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / f"{name}.md").write_text(table + "\n")
        print(f"wrote {out / name}.json and .md", file=sys.stderr)
    return 0


def scenario_config(args: argparse.Namespace, scenario: str) -> Config:
    """The config a scenario runs under: its own preset unless --preset names one (explicit keys still win)."""
    preset = [] if args.preset else [f"cache.preset={scenario if scenario in PRESETS else 'none'}"]
    return load_config(args.config, preset + build_overrides(args))  # the modes switch segment reuse per run


def bench_url(args: argparse.Namespace, scenarios: list[str], num_requests: int, max_tokens: int) -> dict:
    from tqdm import tqdm

    from kvreuse.bench import replay, workloads

    report = {"suite": "replay", "url": args.url, "requests": num_requests, "max_tokens": max_tokens,
              "scenarios": {}}
    for scenario in scenarios:
        conversations = workloads.WORKLOADS[scenario](num_requests)
        with tqdm(total=len(conversations), desc=f"{scenario} @ {args.url}", unit="req", leave=False,
                  disable=None) as bar:  # no bar when stderr is not a terminal
            try:
                report["scenarios"][scenario] = replay.run(
                    args.url, conversations, model=args.served_model, max_tokens=max_tokens,
                    concurrency=args.concurrency, request_rate=args.request_rate, api_key=args.api_key,
                    progress=bar.update)
            except (RuntimeError, ValueError) as exc:
                raise InputError(str(exc)) from exc
    return report


def cmd_fidelity(args: argparse.Namespace) -> int:
    from kvreuse.bench import fidelity

    overrides = list(args.overrides) + ([f"cache.block_size={args.block_size}"] if args.block_size else [])
    report = fidelity.fidelity_report(num_requests=args.requests, seed=args.seed, modes=args.modes,
                                      overrides=overrides, progress=lambda line: print(line, file=sys.stderr),
                                      continuation=args.continuation, workload=args.workload)
    print(json.dumps(report, indent=2) if args.json else fidelity.markdown(report))
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from kvreuse.analyze import analyze, read_prompts, text_report

    config = build_config(args)
    try:
        prompts = read_prompts(args.prompts_file)
    except OSError as exc:
        raise InputError(f"cannot read {args.prompts_file}: {exc.strerror}") from exc
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if not prompts:
        raise InputError(f"{args.prompts_file}: no prompts")
    report = analyze(prompts, config)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else text_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvreuse", description="LLM inference built around KV-cache reuse")
    sub = parser.add_subparsers(dest="command", required=True)

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

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _common_flags(serve)
    serve.add_argument("--host", help="shorthand for --set server.host= (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="shorthand for --set server.port= (default 8000; 0 = any free port)")
    serve.add_argument("--api-keys", help="file of API keys -> tenants (shorthand for --set server.api_keys_file=)")
    serve.add_argument("--served-model-name", help="model id clients use (default: the weights file name)")
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks: engine and prefix suites (medians of interleaved runs), "
                                         "scenarios in-process or against a server (--url)")
    _common_flags(bench)
    bench.add_argument("--scenario", choices=[*WORKLOADS, "all"],
                       help="the seed's scenarios (prefix: SGLang's generated-shared-prefix) in modes no-cache, "
                            "prefix, shift, blend, each under its own preset unless --preset is given")
    bench.add_argument("--quick", action="store_true", help="scenario: 4 requests x 4 tokens (a smoke run)")
    bench.add_argument("--requests", type=int, help="scenario: requests per scenario (default 24)")
    bench.add_argument("--max-tokens", type=int, help="scenario: completion tokens per request (default 16)")
    bench.add_argument("--suite", choices=["engine", "prefix"], default="prefix",
                       help="engine: cold prefill and decode vs HF transformers / llama.cpp; "
                            "prefix: cold vs warm TTFT of a 2048-token prompt")
    bench.add_argument("--repeats", type=int, default=3, help="measured rounds (after one warm-up round)")
    bench.add_argument("--no-bf16", action="store_true", help="engine suite: skip HF bf16 (slow without AVX512-BF16)")
    bench.add_argument("--concurrency", type=int, help="requests in flight (scenario default 1, --url: no cap)")
    bench.add_argument("--no-peers", action="store_true", help="scenario: skip the HF transformers peer")
    bench.add_argument("--url", help="replay the scenario(s) against an OpenAI-compatible server at this root URL")
    bench.add_argument("--request-rate", type=float, default=float("inf"),
                       help="--url: Poisson arrivals per second (default inf: all at once)")
    bench.add_argument("--served-model", help="--url: model name to send (default: the first of GET /v1/models)")
    bench.add_argument("--api-key", default="EMPTY", help="--url: bearer token")
    bench.add_argument("--out", help="directory for <suite>.json and <suite>.md (scenario: and PNG plots)")
    bench.set_defaults(func=cmd_bench)

    fid = sub.add_parser("fidelity", help="segment reuse against exact recompute on a built-in workload")
    fid.add_argument("--requests", type=int, default=24, help="requests (default 24)")
    fid.add_argument("--seed", type=int, default=0, help="workload seed")
    fid.add_argument("--workload", choices=list(WORKLOADS), default="rag",
                     help="rag: 2-3 documents per query in varying order; eval: varying answer + fixed rubric; "
                          "chat: multi-turn follow-ups; agent: variable tool results + fixed tool rules; "
                          "prefix: groups sharing a long system prompt")
    fid.add_argument("--modes", nargs="+", choices=["prefix-only", "shift-noguard", "shift", "blend-noguard",
                                                    "blend", "blend-1.0"], help="default: all")
    fid.add_argument("--continuation", type=int, default=32, help="greedy tokens compared per request")
    fid.add_argument("--block-size", type=int, help="shorthand for --set cache.block_size=")
    fid.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="e.g. cache.suffix.recompute_ratio=0.3, cache.suffix.guard_margin=0")
    fid.add_argument("--json", action="store_true", help="the whole report as JSON")
    fid.add_argument("--log-level", default="WARNING")
    fid.set_defaults(func=cmd_fidelity)

    ana = sub.add_parser("analyze", help="why is the hit rate low? diagnose a prompt log without running the model")
    _common_flags(ana)
    ana.add_argument("prompts_file", help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    ana.add_argument("--json", action="store_true", help="the report as JSON")
    ana.set_defaults(func=cmd_analyze)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvreuse: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InputError as exc:
        print(f"kvreuse: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelLoadError as exc:
        print(f"kvreuse: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
