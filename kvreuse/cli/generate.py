"""`kvreuse generate`: completions offline, one request after another (so later ones reuse earlier KV) or batched."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from kvreuse.cli.common import InputError, build_config, common_flags, progress
from kvreuse.prompts_file import PromptRecord, read_prompts_file

if TYPE_CHECKING:
    from kvreuse.engine.stats import EngineSnapshot


def add_generate(sub) -> None:
    """The `generate` command."""
    gen = sub.add_parser("generate", help="generate completions offline")
    common_flags(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (plain text; with --chat, user messages)")
    gen.add_argument("--input", help='JSONL file: {"prompt": ...} or {"messages": [...]} per line')
    gen.add_argument("--chat", action="store_true", help="wrap argument prompts in the model's chat template")
    gen.add_argument("--max-tokens", type=int, help="completion tokens per request (default server.default_max_tokens)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, help="sampling seed")
    gen.add_argument("--json", action="store_true", help="one JSON object per request per line")
    gen.add_argument("--batch", action="store_true", help="submit all requests at once (continuous batching)")
    gen.set_defaults(func=cmd_generate)


def _argument_prompts(prompts: list[str], chat: bool) -> list[PromptRecord]:
    if chat:
        return [PromptRecord(line=i, messages=[{"role": "user", "content": p}]) for i, p in enumerate(prompts, 1)]
    return [PromptRecord(line=i, prompt=p) for i, p in enumerate(prompts, 1)]


def _requests(args: argparse.Namespace, records: list[PromptRecord], llm, default_max: int) -> tuple[list, list]:
    """Each record's prompt (chat messages tokenized) and SamplingParams, the flags filling what a record omits."""
    from kvreuse.sampling_params import SamplingParams

    prompts, params = [], []
    for r in records:
        where = f"{args.input}, line {r.line}" if args.input else f"prompt {r.line}"
        try:
            p = SamplingParams(max_tokens=default_max if r.max_tokens is None else r.max_tokens,
                               temperature=args.temperature if r.temperature is None else r.temperature,
                               seed=args.seed)
            prompt = llm.engine.front_end.tokenize_chat(r.messages) if r.messages is not None else r.prompt
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from exc
        prompts.append(prompt)
        params.append(p)
    return prompts, params


def _emit(out, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out.to_json(), ensure_ascii=False), flush=True)
        return
    print(out.text, flush=True)
    u = out.usage
    print(f"[{out.request_id}] prompt={u.prompt_tokens} cached={u.cached_tokens} "
          f"completion={u.completion_tokens} finish={out.finish_reason} ttft={out.ttft_s * 1000:.0f}ms "
          f"total={out.total_s:.2f}s", file=sys.stderr, flush=True)


def _print_summary(s: EngineSnapshot) -> None:
    reuse = s.reuse
    print(f"[summary] requests={s.num_requests} hit_rate={round(reuse.hit_rate, 4):.3f} prompt={reuse.prompt_tokens} "
          f"cached={reuse.cached_tokens} computed={reuse.computed_prompt_tokens} evictions={s.evictions} "
          f"({s.eviction_policy}) peak_kv_in_use={s.peak_kv_bytes_in_use / 2**20:.1f}MiB "
          f"peak_rss={s.peak_rss_bytes / 2**20:.0f}MiB", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run the prompts given as arguments or in --input; texts on stdout, per-request stats on stderr."""
    from kvreuse.engine.errors import RequestError
    from kvreuse.llm import LLM

    config = build_config(args)
    records = read_prompts_file(args.input) if args.input else _argument_prompts(args.prompts, args.chat)
    if not records:
        raise InputError("nothing to generate: give prompts as arguments or --input FILE.jsonl")

    started = time.perf_counter()
    progress("kvreuse: loading the model (a machine's first run also measures its CPU and builds kernels: a minute "
             "or two)")
    with LLM(config) as llm:
        graph = llm.engine.runner.decode_graph
        progress(f"kvreuse: loaded in {time.perf_counter() - started:.1f} s; decode step "
                 f"{graph.state if graph else 'eager (engine.compile = off)'}"
                 + ("" if graph is None or graph.state != "eager" else " (its graphs are not built yet: `kvreuse "
                    "serve` builds them, once)"))
        prompts, params = _requests(args, records, llm, args.max_tokens or config.server.default_max_tokens)
        try:
            if args.batch:
                for out in llm.generate(prompts, params):
                    _emit(out, args.json)
            else:
                # In input order, each after the previous one, so later requests can reuse earlier KV.
                for prompt, p in zip(prompts, params, strict=True):
                    _emit(llm.generate(prompt, p)[0], args.json)
        except RequestError as exc:
            raise InputError(str(exc)) from exc
    _print_summary(llm.engine.stats_snapshot())
    return 0
