"""A GGUF's vocabulary as a Hugging Face tokenizer, converted once and then kept in the model cache.

The conversion is transformers' own (`convert_gguf_tokenizer`, what `AutoTokenizer.from_pretrained(gguf_file=...)`
runs), fed with the metadata as gguf_metadata reads it. AutoTokenizer would first build the model's whole config
with gguf's GGUFReader only to pick a wrapper class (~10 s on Gemma 3's 262k-token vocabulary); the tokenizer it
wraps, and so every token id, is the same (tests/test_gguf_tokenizer.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from importlib.metadata import version
from pathlib import Path

from kvreuse.cache_dir import cache_root
from kvreuse.weights.gguf_metadata import GGUFFields, read_gguf

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
_TOKENS_FILE = "special_tokens.json"  # the named special tokens and the chat template, beside tokenizer.json


def cache_dir(fingerprint: str) -> Path:
    """Where the tokenizer converted from the weights with this fingerprint is kept; the transformers version is in
    the name, since the conversion is its."""
    return cache_root() / "tokenizers" / f"{fingerprint[:16]}-transformers{version('transformers')}"


def load_gguf_tokenizer(path: Path, fingerprint: str):
    """The tokenizer of the GGUF at `path` (a transformers TokenizersBackend), from the cache if it was converted
    before, else converted and cached. A cache that fails to load is converted again, never an error."""
    cached = cache_dir(fingerprint)
    if (cached / "tokenizer.json").is_file():
        try:
            return _from_cache(cached)
        except Exception as exc:  # a stale or partial cache is rebuilt, never fatal
            logger.warning("ignoring tokenizer cache %s: %s", cached, exc)
    tokenizer = convert_gguf(path)
    _write_cache(cached, tokenizer)
    return tokenizer


def convert_gguf(path: Path):
    """transformers' conversion of the GGUF's vocabulary: its tokenizer.json, special tokens and chat template."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = _tokenizer_fields(read_gguf(path).fields)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra)


def _tokenizer_fields(fields: GGUFFields) -> tuple[str, dict, dict]:
    """What transformers' `get_gguf_tokenizer` returns for these fields: (architecture, tokenizer dict, tokenizer
    config), with its renames and its per-vocabulary defaults."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    grouped = {group: {name: _plain(fields[f"tokenizer.{key}"]) for key, name in renames.items()
                       if f"tokenizer.{key}" in fields}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a SentencePiece vocabulary unless told not
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False  # its chat template writes <bos> itself
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
           "pad_token": "padding_token_id"}
    for name, key in ids.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return fields["general.architecture"], tokenizer, config


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


def _write_cache(cached: Path, tokenizer) -> None:
    # Written to a private folder, then renamed into place, so a concurrent reader never sees half a cache.
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        named = {name: getattr(tokenizer, name) for name in SPECIAL_TOKENS}
        (tmp / _TOKENS_FILE).write_text(json.dumps({**named, "chat_template": tokenizer.chat_template},
                                                   ensure_ascii=False), encoding="utf-8")
        shutil.rmtree(cached, ignore_errors=True)  # a stale cache that failed to load
        os.replace(tmp, cached)
    except OSError as exc:
        logger.info("could not cache the tokenizer in %s: %s", cached, exc)
        shutil.rmtree(tmp, ignore_errors=True)


def _from_cache(cached: Path):
    from transformers import TokenizersBackend

    saved = json.loads((cached / _TOKENS_FILE).read_text(encoding="utf-8"))
    tokenizer = TokenizersBackend(tokenizer_file=str(cached / "tokenizer.json"),
                                  **{name: saved[name] for name in SPECIAL_TOKENS})
    tokenizer.chat_template = saved["chat_template"]
    return tokenizer
