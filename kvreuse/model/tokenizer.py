"""Tokenizer and chat template, read from the model's own files (GGUF metadata or an HF directory)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


def _cache_dir(fingerprint: str) -> Path:
    root = Path(os.environ.get("KVREUSE_CACHE_DIR", Path.home() / ".cache" / "kvreuse"))
    return root / "tokenizers" / fingerprint[:16]


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        # Encode/decode go straight to the Rust tokenizer: transformers' wrapper reconfigures it per call,
        # which is not safe when the server's event loop and the engine thread use it at once.
        self._backend = hf_tokenizer.backend_tokenizer
        # Text generation stops at the model's EOS and at its end-of-text token when it has one.
        ids = {hf_tokenizer.eos_token_id} | {hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>",)}
        self.eos_token_ids = frozenset(i for i in ids if i is not None and i != hf_tokenizer.unk_token_id)

    @classmethod
    def load(cls, model_path: Path, fingerprint: str) -> Tokenizer:
        """Converting a GGUF vocabulary takes seconds, so the converted tokenizer is kept on disk,
        keyed by the weights' fingerprint."""
        from transformers import AutoTokenizer

        if model_path.is_dir():
            return cls(AutoTokenizer.from_pretrained(str(model_path)))
        cached = _cache_dir(fingerprint)
        if (cached / "tokenizer.json").is_file():
            try:
                return cls(AutoTokenizer.from_pretrained(str(cached)))
            except Exception as exc:  # a stale or partial cache is rebuilt, never fatal
                logger.warning("ignoring tokenizer cache %s: %s", cached, exc)
        tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
        # Written to a private folder, then renamed into place, so a concurrent reader never sees half a cache.
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        try:
            tokenizer.save_pretrained(str(tmp))
            shutil.rmtree(cached, ignore_errors=True)  # a stale cache that failed to load above
            os.replace(tmp, cached)
        except OSError as exc:
            logger.info("could not cache the tokenizer in %s: %s", cached, exc)
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Renders with the model's own template (transformers runs it in a sandboxed jinja2)."""
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt instead of messages")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
