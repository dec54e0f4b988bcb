"""`kvreuse bench windows`: which sliding-window blocks the cache should keep (bench/window_retention.py): the scenario
workloads through the cache manager over a sliding-window model's grouped pool, per window retention and pool size,
beside the same memory with every layer's K/V kept (swa-full). No model runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvreuse.cli.common import CHAT_TEMPLATE_HELP, InputError, check_plots, log_level_flag, positive_int, progress

# The base Gemma 3 270M carries no chat template: the example one is its default here.
GEMMA_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "gemma3-chat.jinja"
QUICK_REQUESTS = 8
QUICK_MULTIPLES = (1, 4)


def add_windows(suites) -> None:
    """`bench windows`: each window retention at each pool size, per scenario."""
    from kvreuse.bench import window_retention as wr
    from kvreuse.config import CacheConfig
    from kvreuse.kvcache.eviction import POLICIES

    windows = suites.add_parser(
        "windows", help="which sliding-window blocks to keep: the scenarios through the cache manager per window "
                        "retention (cold, policy, end) and pool size, beside swa-full (no model run)",
        description="Replays the scenario workloads, tokenized with the model's tokenizer, through the engine's own "
                    "cache manager over the model's grouped pool layout, without running it (so the numbers are "
                    "deterministic), once per window retention and capacity, and once with every layer's K/V kept "
                    "in the same memory (swa-full). Prints the exact prefix hit rate, the prefill tokens computed "
                    "and the evictions.")
    windows.add_argument("--model", default=wr.DEFAULT_MODEL,
                         help=f"a sliding-window model: a name, .gguf file or HF directory (default "
                              f"{wr.DEFAULT_MODEL})")
    windows.add_argument("--chat-template", metavar="FILE",
                         help=f"{CHAT_TEMPLATE_HELP} (default: the model's own; for {wr.DEFAULT_MODEL}, "
                              "examples/gemma3-chat.jinja)")
    windows.add_argument("--scenarios", nargs="+", choices=list(wr.SCENARIOS), metavar="SCENARIO",
                         default=list(wr.DEFAULT_SCENARIOS),
                         help=f"of {', '.join(wr.SCENARIOS)} (default {' '.join(wr.DEFAULT_SCENARIOS)})")
    windows.add_argument("--requests", type=positive_int,
                         help=f"requests per scenario (default {wr.DEFAULT_REQUESTS}; --quick: {QUICK_REQUESTS})")
    windows.add_argument("--capacities", type=positive_int, nargs="+", metavar="BLOCKS",
                         help="pool sizes in blocks of the grouped layout, for every scenario (default, per "
                              "scenario: " + ", ".join(f"{m:g}" for m in wr.DEFAULT_MULTIPLES) + " x the blocks its "
                              "largest prompt holds, and the size where nothing is evicted)")
    windows.add_argument("--block-size", type=positive_int, default=CacheConfig().block_size,
                         help=f"cache.block_size (default {CacheConfig().block_size})")
    windows.add_argument("--policy", choices=list(POLICIES), default=CacheConfig().policy,
                         help=f"cache.policy (default {CacheConfig().policy})")
    windows.add_argument("--quick", action="store_true",
                         help=f"a smoke run: {QUICK_REQUESTS} requests, capacities "
                              + ", ".join(f"{m:g}" for m in QUICK_MULTIPLES) + "x and no pressure")
    windows.add_argument("--no-plot", action="store_true", help=f"with --out, skip {wr.PNG}")
    windows.add_argument("--out", metavar="DIR", help=f"directory for window-retention.json, .md and {wr.PNG}")
    log_level_flag(windows)
    windows.set_defaults(func=cmd_bench_windows)


def load(model: str, chat_template: str | None):
    """The model's args, tokenizer (under `chat_template`, or the default one) and fingerprint, without weights."""
    from kvreuse.bench.window_retention import DEFAULT_MODEL
    from kvreuse.weights.loader import load_model_info
    from kvreuse.weights.tokenizer import Tokenizer

    info = load_model_info(model)
    if chat_template is None and model == DEFAULT_MODEL and GEMMA_TEMPLATE.is_file():
        chat_template = str(GEMMA_TEMPLATE)
    if chat_template is not None and not Path(chat_template).is_file():
        raise InputError(f"--chat-template {chat_template}: no such file")
    return info.args, Tokenizer.load(info.path, info.fingerprint, chat_template), info.fingerprint


def cmd_bench_windows(args: argparse.Namespace) -> int:
    """Tokenize the scenarios, replay them per retention and capacity, print the tables; with --out also the report,
    the tables and the PNG."""
    from tqdm import tqdm

    from kvreuse.bench import window_retention as wr
    from kvreuse.bench.commands import write_report
    from kvreuse.config import CacheConfig
    from kvreuse.kvcache.layout import KVLayout
    from kvreuse.weights.chat_template import NoChatTemplate

    check_plots(None if args.no_plot else args.out)
    model_args, tokenizer, fingerprint = load(args.model, args.chat_template)
    if not KVLayout.of(model_args).is_grouped:
        raise InputError(f"{args.model}: no grouped KV layout (it does not mix full-attention and sliding-window "
                         "layers), so there are no window blocks to keep")
    num_requests = args.requests or (QUICK_REQUESTS if args.quick else wr.DEFAULT_REQUESTS)
    multiples = QUICK_MULTIPLES if args.quick else wr.DEFAULT_MULTIPLES
    scenarios = list(dict.fromkeys(args.scenarios))
    try:
        prompts = wr.scenario_prompts(tokenizer, scenarios, num_requests)
    except NoChatTemplate as exc:
        raise InputError(f"{args.model}: {exc}; give one with --chat-template FILE") from exc
    cache = CacheConfig(block_size=args.block_size, policy=args.policy)
    total = wr.num_replays(prompts, args.capacities, multiples, model_args, args.block_size)
    with tqdm(total=total, desc="windows", unit="replay", leave=False, file=sys.stderr) as bar:
        report = wr.run(model_args, prompts, fingerprint, cache=cache, capacities=args.capacities,
                        multiples=multiples, model=args.model, bar=bar,
                        progress=lambda line: bar.write(line, file=sys.stderr))
    table = wr.markdown(report)
    print(table)
    if args.out:
        out = Path(args.out)
        write_report(out, "window-retention", report, table)
        if not args.no_plot:
            progress(f"wrote {wr.plot(report, out / wr.PNG)}")
    return 0
