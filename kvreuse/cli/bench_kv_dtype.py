"""`kvreuse bench kv-dtype`: the decode step's rate per `cache.kv_dtype` at long contexts (bench/kv_dtype_bench.py)."""

from __future__ import annotations

import argparse

from kvreuse.cli.common import InputError, log_level_flag, out_flag, positive_int, progress, publish, repeats_flag

# kv_dtype_bench's defaults, kept here so that building the parser imports no torch
KV_DTYPES = ("fp32", "bf16", "int8", "fp8")
CASES = ("8x8192", "8x2048", "1x2048")


def add_kv_dtype(suites) -> None:
    parser = suites.add_parser("kv-dtype", help="decode step rate per cache.kv_dtype (fp32, bf16, int8, fp8 K/V) at "
                                                "2k and 8k contexts, interleaved rounds",
                               description="Times the default model's decode step (fp32) over a pool of each "
                                           "cache.kv_dtype, with every prompt prefilled once and kept in the prefix "
                                           "cache: medians of interleaved rounds, and each step rate over the fp32 "
                                           "pool's.")
    repeats_flag(parser)
    parser.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=list(KV_DTYPES), metavar="DTYPE",
                        help=f"of {', '.join(KV_DTYPES)} (default all)")
    parser.add_argument("--cases", nargs="+", metavar="BxCONTEXT", default=list(CASES),
                        help=f"batch x context tokens (default {' '.join(CASES)})")
    parser.add_argument("--eager", action="store_true", help="decode eagerly (engine.compile=off)")
    out_flag(parser, "kv-dtype")
    log_level_flag(parser)
    parser.set_defaults(func=cmd_bench_kv_dtype)


def cmd_bench_kv_dtype(args: argparse.Namespace) -> int:
    from kvreuse.bench import kv_dtype_bench as kb

    cases = []
    for text in args.cases:
        batch, _, context = text.partition("x")
        if not (batch.isdigit() and context.isdigit()) or int(context) <= kb.DECODE_TOKENS + 16 or int(batch) < 1:
            raise InputError(f"--cases {text!r}: expected BATCHxCONTEXT, a context over {kb.DECODE_TOKENS + 16}")
        cases.append(kb.Case(positive_int(batch), int(context)))
    report = kb.run(repeats=args.repeats, kv_dtypes=tuple(args.kv_dtypes), cases=tuple(cases),
                    compile="off" if args.eager else "decode", progress=progress)
    return publish("kv-dtype", report, kb.markdown(report), args.out)
