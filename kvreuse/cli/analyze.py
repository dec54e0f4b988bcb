"""`kvreuse analyze`: why the hit rate of a prompt log is low, without running the model."""

from __future__ import annotations

import argparse
import json

from kvreuse.cli.common import InputError, build_config, common_flags
from kvreuse.prompts_file import read_prompts_file


def add_analyze(sub) -> None:
    """The `analyze` command."""
    ana = sub.add_parser("analyze", help="why is the hit rate low? diagnose a prompt log without running the model")
    common_flags(ana)
    ana.add_argument("prompts_file", help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    ana.add_argument("--json", action="store_true", help="the report as JSON")
    ana.set_defaults(func=cmd_analyze)


def cmd_analyze(args: argparse.Namespace) -> int:
    """Print the diagnosis of the prompt file, as text or JSON."""
    from kvreuse.analyze import analyze, text_report

    config = build_config(args)
    records = read_prompts_file(args.prompts_file)
    if not records:
        raise InputError(f"{args.prompts_file}: no prompts")
    report = analyze([r.text_or_messages for r in records], config)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else text_report(report))
    return 0
