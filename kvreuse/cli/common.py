"""What every command shares: the config flags and how they become a Config, small option types, how a report is
published, and how errors become exit codes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args

from pydantic import BaseModel

from kvreuse.config import CacheConfig, Config, ConfigError, ModelConfig, load_config
from kvreuse.extras import PLOTS, MissingExtraError, explain, require
from kvreuse.prompts_file import PromptsFileError
from kvreuse.weights.errors import ModelLoadError

EXIT_USAGE = 2

# The vLLM-style shorthand flags, by argparse dest, and the config key each sets. Each command has some of them.
SHORTHANDS = {
    "model": "model.path",
    "chat_template": "model.chat_template",
    "tool_call_parser": "model.tool_call_parser",
    "device": "model.device",
    "dtype": "model.dtype",
    "quantization": "model.quantization",
    "weights": "model.weights",
    "served_model_name": "model.served_name",
    "block_size": "cache.block_size",
    "kv_cache_dtype": "cache.kv_dtype",
    "max_model_len": "server.max_tokens",
    "enable_prefix_caching": "cache.enabled",
    "preset": "cache.preset",
    "host": "server.host",
    "port": "server.port",
    "api_keys": "server.api_keys_file",
    "admin_api_keys": "server.admin_api_keys_file",
    "replicas": "cluster.replicas",
    "ray_address": "cluster.ray_address",
}
CONFIG_SECTIONS = ", ".join(f"[{section}]" for section in Config.model_fields)
MODEL_HELP = ("gemma3-270m, or a .gguf file or Hugging Face directory of a supported architecture (llama, mistral, "
              "qwen2, qwen3, gemma3, phi3) (default: the embedded SmolLM2-135M-Instruct)")
CHAT_TEMPLATE_HELP = "a Jinja chat template file, used instead of the model's own (a base model has none)"


class InputError(ValueError):
    """A command's input (arguments, prompt file, request) cannot be used; exits with EXIT_USAGE."""


def choices_of(section: type[BaseModel], field: str) -> list[str]:
    """The values the Literal config field `section.field` allows, so a flag offers exactly what the config takes."""
    return list(get_args(section.model_fields[field].annotation))


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The --set assignments, then the shorthand flags given, so a flag wins over --set for the same key."""
    given = ((key, getattr(args, dest, None)) for dest, key in SHORTHANDS.items())
    return [*args.overrides, *(f"{key}={value}" for key, value in given if value is not None)]


def build_config(args: argparse.Namespace) -> Config:
    """Shorthand flags > --set > the --config file > defaults."""
    return load_config(args.config, config_overrides(args))


def shorthand(dest: str) -> str:
    """Help text naming the config key a shorthand flag sets."""
    return f"shorthand for --set {SHORTHANDS[dest]}="


def log_level_flag(parser: argparse.ArgumentParser) -> None:
    """--log-level, which every command has."""
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO (per-request cache-hit log), WARNING")


def common_flags(parser: argparse.ArgumentParser) -> None:
    """--config, --set and the shorthand flags of the model and cache keys, for commands that build a Config."""
    parser.add_argument("--config", help=f"INI config file ({CONFIG_SECTIONS} keys; see docs/configuration.md)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable; wins over the file")
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--chat-template", metavar="FILE", help=f"{CHAT_TEMPLATE_HELP} ({shorthand('chat_template')})")
    parser.add_argument("--tool-call-parser", choices=choices_of(ModelConfig, "tool_call_parser"),
                        help=f"the tool-call format ({shorthand('tool_call_parser')})")
    parser.add_argument("--device", choices=choices_of(ModelConfig, "device"), help=shorthand("device"))
    parser.add_argument("--dtype", choices=choices_of(ModelConfig, "dtype"), help=shorthand("dtype"))
    parser.add_argument("--quantization", choices=choices_of(ModelConfig, "quantization"),
                        help=f"weight-only, approximate ({shorthand('quantization')})")
    parser.add_argument("--weights", choices=choices_of(ModelConfig, "weights"),
                        help=f"decode from the GGUF's own blocks or dense weights ({shorthand('weights')})")
    parser.add_argument("--block-size", type=int, help=shorthand("block_size"))
    parser.add_argument("--kv-cache-dtype", choices=choices_of(CacheConfig, "kv_dtype"),
                        help=f"how the KV pool holds K/V; int8 and fp8 are approximate ({shorthand('kv_cache_dtype')})")
    parser.add_argument("--preset", choices=choices_of(CacheConfig, "preset"),
                        help=f"scenario preset ({shorthand('preset')}); explicit keys override it")
    parser.add_argument("--max-model-len", type=int, help=f"{shorthand('max_model_len')} (context limit)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help=shorthand("enable_prefix_caching"))
    log_level_flag(parser)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    problem = argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    try:
        value = int(text)
    except ValueError:
        raise problem from None
    if value < 1:
        raise problem
    return value


def repeats_flag(parser: argparse.ArgumentParser) -> None:
    """--repeats of the suites that measure in interleaved rounds."""
    parser.add_argument("--repeats", type=positive_int, default=3, help="measured rounds (after one warm-up round)")


def out_flag(parser: argparse.ArgumentParser, name: str, extra: str = "") -> None:
    """--out DIR of a bench suite, which then writes NAME.json and NAME.md there."""
    parser.add_argument("--out", metavar="DIR", help=f"directory for {name}.json and {name}.md{extra}")


def check_plots(out: str | None) -> None:
    """With --out, that its plots can be drawn (the bench extra): MissingExtraError before the run, not after it."""
    if out:
        require("matplotlib", "bench", PLOTS)


def progress(line: str) -> None:
    """A bench suite's progress lines go to stderr, so stdout holds only the table."""
    print(line, file=sys.stderr, flush=True)


def publish(name: str, report: dict, table: str, out: str | None) -> int:
    """Print a suite's Markdown table and, with --out, write it and the JSON report."""
    from kvreuse.bench.commands import write_report

    print(table)
    if out:
        write_report(Path(out), name, report, table)
    return 0


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command's handler; a bad config or input exits with EXIT_USAGE, a model that fails to load or a
    feature whose extra is not installed with 1."""
    try:
        return command(args)
    except MissingExtraError as exc:
        print(f"kvreuse: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:  # an extra's module imported without `require`
        hint = explain(exc)
        if hint is None:
            raise
        print(f"kvreuse: {hint}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"kvreuse: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (InputError, PromptsFileError) as exc:
        print(f"kvreuse: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelLoadError as exc:
        print(f"kvreuse: {exc}", file=sys.stderr)
        return 1
