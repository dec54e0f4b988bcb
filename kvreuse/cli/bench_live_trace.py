"""`kvreuse bench replay URL --trace FILE`: the flags of a live trace replay, and the command that runs it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kvreuse.bench.trace import MOONCAKE_HASH_BLOCK_TOKENS
from kvreuse.bench.vocab_prompts import FIRST_ORDINARY_ID, SMOLLM2_VOCAB_SIZE
from kvreuse.cli.common import InputError, positive_int, progress, publish

# Flag -> dest of the flags that only a trace replay takes (their defaults are applied by cmd_replay_trace).
TRACE_ONLY_FLAGS = {"--tokens-per-hash": "tokens_per_hash", "--hash-block-tokens": "hash_block_tokens",
                    "--time-scale": "time_scale", "--num-requests": "num_requests", "--start": "start",
                    "--max-output-tokens": "max_output_tokens", "--vocab-size": "vocab_size",
                    "--arrival-slack-ms": "arrival_slack_ms", "--seed": "seed"}


class GivenFlag(argparse.Action):
    """Stores the value and records the flag in `namespace.given_flags`, so a flag with a default can be told
    apart from one the caller gave (the scenario replay's flags are refused beside --trace)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given_flags = [*getattr(namespace, "given_flags", []), option_string]


def non_negative(kind: type) -> Callable[[str], float]:
    """An argparse type: a number (int or float) >= 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= 0:
            raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
        return value
    return parse


def vocab_size(text: str) -> int:
    value = positive_int(text)
    if value <= FIRST_ORDINARY_ID:
        raise argparse.ArgumentTypeError(f"expected an integer above {FIRST_ORDINARY_ID}, got {text!r}")
    return value


def add_trace_flags(replay: argparse.ArgumentParser) -> None:
    """--trace and the flags of a live trace replay."""
    trace = replay.add_argument_group("trace replay (--trace; no scenarios)")
    trace.add_argument("--trace", metavar="FILE",
                       help="replay this Mooncake JSONL trace live instead of the scenarios: token-id prompts from "
                            "its hash ids sent to /v1/completions at its timestamps")
    trace.add_argument("--tokens-per-hash", type=positive_int,
                       help=f"tokens per hash id (default {MOONCAKE_HASH_BLOCK_TOKENS}: the trace at full size)")
    trace.add_argument("--hash-block-tokens", type=positive_int,
                       help=f"tokens per hash id in the trace (default {MOONCAKE_HASH_BLOCK_TOKENS}, Mooncake's)")
    trace.add_argument("--time-scale", type=non_negative(float),
                       help="multiplies the trace's gaps: 1 real time (default), 0.1 ten times faster, 0 all at once")
    trace.add_argument("--start", type=non_negative(int), help="first request replayed, by index (default 0)")
    trace.add_argument("--num-requests", type=positive_int, help="requests replayed from --start (default: all)")
    trace.add_argument("--max-output-tokens", type=positive_int,
                       help="cap on max_tokens, which is each request's output_length (default: no cap)")
    trace.add_argument("--vocab-size", type=vocab_size,
                       help=f"the served model's vocabulary, where prompt ids are drawn (default {SMOLLM2_VOCAB_SIZE}, "
                            "SmolLM2's)")
    trace.add_argument("--arrival-slack-ms", type=non_negative(float),
                       help="a request sent later than this after its time missed its arrival (default 50)")
    trace.add_argument("--seed", type=int, help="seed of the token ids drawn per hash id (default 0)")


def cmd_replay_trace(args: argparse.Namespace) -> int:
    """Replay the slice of the trace live against URL; print the table, with --out also live-trace.json/.md."""
    from kvreuse.bench import live_trace
    from kvreuse.bench.trace import TraceError, read_trace

    refused = [*dict.fromkeys(getattr(args, "given_flags", []))]
    refused += ["--turns"] * (args.turns is not None) + ["--sessions"] * args.sessions
    refused += ["SCENARIO"] * bool(args.scenarios)
    if refused:
        raise InputError(f"--trace replays the trace, not the scenarios: leave out {', '.join(refused)}")
    try:
        requests = read_trace(args.trace)
    except (OSError, TraceError) as exc:
        raise InputError(f"--trace: {exc}") from exc
    start = args.start or 0
    chosen = requests[start:start + args.num_requests if args.num_requests else None]
    if not chosen:
        raise InputError(f"--trace {args.trace}: no requests from --start {start} (the trace has {len(requests)})")
    slack_ms = 50.0 if args.arrival_slack_ms is None else args.arrival_slack_ms
    try:
        report = live_trace.run(
            args.url, chosen, tokens_per_hash=args.tokens_per_hash or MOONCAKE_HASH_BLOCK_TOKENS,
            hash_block_tokens=args.hash_block_tokens or MOONCAKE_HASH_BLOCK_TOKENS,
            time_scale=1.0 if args.time_scale is None else args.time_scale, max_output_tokens=args.max_output_tokens,
            vocab_size=args.vocab_size or SMOLLM2_VOCAB_SIZE, concurrency=args.concurrency,
            arrival_slack_s=slack_ms / 1000, model=args.served_model, api_key=args.api_key, seed=args.seed or 0)
    except (RuntimeError, ValueError) as exc:
        raise InputError(str(exc)) from exc
    progress(f"replayed {len(chosen)} requests of {args.trace} from index {start}")
    report = {"suite": "live-trace", "trace": Path(args.trace).name, "start": start, **report}
    return publish("live-trace", report, live_trace.markdown(report), args.out)
