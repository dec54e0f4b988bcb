"""`kvreuse fidelity`: segment reuse against exact recompute on a built-in workload."""

from __future__ import annotations

import argparse
import json

from kvreuse.bench.workloads import WORKLOADS
from kvreuse.cli.common import choices_of, common_flags, config_overrides, progress
from kvreuse.config import CacheConfig


def add_fidelity(sub) -> None:
    """The `fidelity` command."""
    fid = sub.add_parser("fidelity", help="segment reuse against exact recompute on a built-in workload")
    # --config sits under fidelity's own settings (fp32, 4096-token context, segment reuse on); --set and the
    # shorthand flags win over both.
    common_flags(fid)
    fid.add_argument("--requests", type=int, default=24, help="requests (default 24)")
    fid.add_argument("--seed", type=int, default=0, help="workload seed")
    fid.add_argument("--workload", choices=list(WORKLOADS), default="rag",
                     help="rag: 2-3 documents per query in varying order; eval: varying answer + fixed rubric; "
                          "chat: multi-turn follow-ups; agent: variable tool results + fixed tool rules; "
                          "prefix: groups sharing a long system prompt")
    fid.add_argument("--modes", nargs="+", choices=["prefix-only", "shift-noguard", "shift", "blend-noguard",
                                                    "blend", "blend-1.0"], help="default: all")
    fid.add_argument("--continuation", type=int, default=32, help="greedy tokens compared per request")
    fid.add_argument("--kv-dtype", choices=[c for c in choices_of(CacheConfig, "kv_dtype") if c != "auto"],
                     help="instead of segment reuse: holding K/V in this dtype against fp32 K/V, over 2k-token "
                          "contexts and six parity prompts")
    fid.add_argument("--json", action="store_true", help="the whole report as JSON")
    fid.set_defaults(func=cmd_fidelity)


def cmd_fidelity(args: argparse.Namespace) -> int:
    """Print the fidelity report, as Markdown or JSON."""
    if args.kv_dtype:
        from kvreuse.bench import kv_fidelity

        report = kv_fidelity.kv_fidelity_report(args.kv_dtype, config_overrides(args), args.config, progress)
        print(json.dumps(report, indent=2) if args.json else kv_fidelity.markdown(report))
        return 0
    from kvreuse.bench import fidelity

    report = fidelity.fidelity_report(num_requests=args.requests, seed=args.seed, modes=args.modes,
                                      overrides=config_overrides(args), progress=progress,
                                      continuation=args.continuation, workload=args.workload,
                                      config_file=args.config)
    print(json.dumps(report, indent=2) if args.json else fidelity.markdown(report))
    return 0
