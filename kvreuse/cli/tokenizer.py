"""`kvreuse tokenizer export`: the served tokenizer as a Hugging Face directory, for clients that want one."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvreuse.cli.common import CHAT_TEMPLATE_HELP, MODEL_HELP, InputError, log_level_flag, positive_int
from kvreuse.config import load_config


def add_tokenizer(sub) -> None:
    """The `tokenizer` command and its `export` action."""
    tok = sub.add_parser("tokenizer", help="the model's tokenizer for other tools")
    actions = tok.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser("export", help="write the tokenizer as a Hugging Face directory (tokenizer.json, "
                                               "tokenizer_config.json with the chat template, special_tokens_map.json)"
                                               " without loading the weights")
    export.add_argument("dir", metavar="DIR", help="output directory: new or empty (or see --force)")
    export.add_argument("--model", help=MODEL_HELP)
    export.add_argument("--chat-template", metavar="FILE",
                        help=f"{CHAT_TEMPLATE_HELP}, written to tokenizer_config.json")
    export.add_argument("--max-model-len", type=positive_int,
                        help="model_max_length to write (default: the context limit `kvreuse serve` uses)")
    export.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    log_level_flag(export)
    export.set_defaults(func=cmd_tokenizer_export)


def cmd_tokenizer_export(args: argparse.Namespace) -> int:
    """Write the tokenizer files into DIR, with the context limit the server would report."""
    from kvreuse.config.chat_template import load_chat_template
    from kvreuse.weights.loader import load_model_info
    from kvreuse.weights.tokenizer import Tokenizer

    if args.chat_template:
        try:
            load_chat_template(args.chat_template)
        except ValueError as exc:
            raise InputError(f"--chat-template: {exc}") from None
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
    written = Tokenizer.load(info.path, info.fingerprint, args.chat_template).export(out, max_model_len)
    print(f"wrote {', '.join(p.name for p in written)} to {out} (model_max_length {max_model_len}); load it with "
          f"transformers.AutoTokenizer.from_pretrained({str(out)!r})")
    return 0
