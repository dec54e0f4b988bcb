"""Command line: `kvreuse generate`, `serve`, `bench scenario|engine|prefix|tiers|eval|quant|cluster|replay`,
`fidelity`, `analyze`, `cache warm|stats|clear`, `tokenizer export`; one module per command, its parser beside its
handler, and what they share in common."""

from __future__ import annotations

import argparse
import logging

from kvreuse.cli.analyze import add_analyze
from kvreuse.cli.bench import add_bench
from kvreuse.cli.cache import add_cache
from kvreuse.cli.common import build_config, config_overrides, run_command
from kvreuse.cli.fidelity import add_fidelity
from kvreuse.cli.generate import add_generate
from kvreuse.cli.serve import add_serve
from kvreuse.cli.tokenizer import add_tokenizer

__all__ = ["build_config", "build_parser", "config_overrides", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The `kvreuse` parser with every command; each sets `func`, its handler."""
    parser = argparse.ArgumentParser(prog="kvreuse", description="LLM inference built around KV-cache reuse")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_generate, add_serve, add_bench, add_fidelity, add_analyze, add_cache, add_tokenizer):
        add(sub)
    return parser


STATE_LOGGERS = ("kvreuse.model.decode_graph",)


def main(argv: list[str] | None = None) -> int:
    """The `kvreuse` entry point: parse, set up logging, run the command; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in STATE_LOGGERS:  # their INFO lines are state changes a user must see at the default level
        logger = logging.getLogger(name)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    return run_command(args.func, args)
