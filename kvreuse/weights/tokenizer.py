"""Tokenizer and chat template, read from the model's own files (GGUF metadata or an HF directory).

Two ways text becomes tokens. `encode(text)` takes a caller's whole text: special-token text in it (`<|im_start|>`)
is that special token, as a raw completion prompt expects. `encode_chat(render_chat(messages))` takes a
conversation: only the chat template's own markers become special tokens, and text inside a message is always text,
so a message cannot forge a role or end its turn.
"""

from __future__ import annotations

import json
import re
import secrets
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding
from tokenizers import Tokenizer as RustTokenizer

from kvreuse.cache_dir import write_json_atomically
from kvreuse.config.chat_template import check_self_contained, load_chat_template
from kvreuse.weights.chat_render import ChatRenderer, InProcessRenderer, RenderLimits, WorkerRenderer
from kvreuse.weights.chat_template import NoChatTemplate
from kvreuse.weights.gguf_tokenizer import cache_dir, load_gguf_tokenizer

_FACTS_FILE = "facts.json"  # beside a converted GGUF tokenizer: what Tokenizer computes from its whole vocabulary
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<|eot_id|>")


def check_unicode(text: str) -> None:
    """ValueError if `text` holds a lone surrogate (legal in JSON and in Python strings, but not Unicode text)."""
    found = None if text.isascii() else _LONE_SURROGATE.search(text)  # isascii: one pass in C, no regex
    if found:
        raise ValueError(f"contains a lone surrogate (U+{ord(found.group()):04X} at character {found.start()}): "
                         f"not valid Unicode text")


@dataclass(frozen=True)
class TokenSplice:
    """A message's content given as tokens the model generated (`text`: their decoded text). A conversation that
    echoes a generated turn back is tokenized with the turn's own tokens, not the tokens of its text (which may
    differ, and would miss the cache)."""
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class ChatPiece:
    """A run of a rendered conversation: message text, a template marker (`special`), or spliced `token_ids`."""
    text: str
    special: bool = False
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ChatText:
    """A conversation rendered with the chat template. `text` is the prompt as the model reads it. `pieces` is set
    when a message holds special-token text or a TokenSplice: `text` cut at the template's own special tokens and
    at the splices, in order, so that only the markers are tokenized as special tokens and splices stay as given."""
    text: str
    pieces: tuple[ChatPiece, ...] | None = None


class Tokenizer:
    def __init__(self, hf_tokenizer, facts_file: Path | None = None):
        self.hf = hf_tokenizer
        self.renderer: ChatRenderer = InProcessRenderer(hf_tokenizer)  # a server's renders in a worker (chat_render.py)
        # Encode/decode go straight to the Rust tokenizer: transformers' wrapper reconfigures it per call,
        # which is not safe when the server's preparation threads and the engine thread use it at once.
        self._backend = hf_tokenizer.backend_tokenizer
        self._text_backend_copy: RustTokenizer | None = None
        specials = sorted({t.content for t in self._backend.get_added_tokens_decoder().values() if t.special},
                          key=len, reverse=True)  # longest first: the leftmost-longest match, as the tokenizer does
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.max_token_chars = self._cached_longest_token_chars(facts_file)
        self._uncounted = self._chars_without_tokens()
        # Text generation stops at the model's EOS, at its end-of-text token, and at the end of a turn in the chat
        # formats that have their own token for it (a base model's EOS is not one; it may be given a template).
        ids = {hf_tokenizer.eos_token_id} | {hf_tokenizer.convert_tokens_to_ids(t) for t in END_TOKENS}
        self.eos_token_ids = frozenset(i for i in ids if i is not None and i != hf_tokenizer.unk_token_id)

    @classmethod
    def load(cls, model_path: Path, fingerprint: str, chat_template_file: str | Path | None = None) -> Tokenizer:
        """The tokenizer of an HF directory, or of a GGUF (converted once, then kept on disk keyed by the weights'
        fingerprint). `chat_template_file` (a Jinja file) replaces the model's own chat template."""
        if model_path.is_dir():
            from transformers import AutoTokenizer

            hf_tokenizer, facts_file = AutoTokenizer.from_pretrained(str(model_path)), None
        else:  # a GGUF's fingerprint covers its vocabulary, so what is computed from that is kept with it
            hf_tokenizer = load_gguf_tokenizer(model_path, fingerprint)
            facts_file = cache_dir(fingerprint) / _FACTS_FILE
        if chat_template_file:
            hf_tokenizer.chat_template = load_chat_template(chat_template_file)
        return cls(hf_tokenizer, facts_file)

    def render_in_worker(self, limits: RenderLimits) -> WorkerRenderer:
        """Render conversations in a worker process within `limits` from now on (a server's requests); the renderer,
        whose worker is starting."""
        self.render_in_process()
        self.renderer = WorkerRenderer(self.hf, limits)
        return self.renderer

    def render_in_process(self) -> None:
        """Render conversations on the calling thread again; a worker is stopped."""
        self.renderer.close()
        self.renderer = InProcessRenderer(self.hf)

    @property
    def _text_backend(self) -> RustTokenizer:
        # A copy that reads special-token text as plain text, for the text inside chat messages: a copy rather than
        # toggling the flag per call, for the same reason. Made when first needed (a message holding special-token
        # text): copying a large vocabulary takes a second or two. Threads racing here make equal copies.
        if self._text_backend_copy is None:
            backend = RustTokenizer.from_str(self._backend.to_str())
            backend.encode_special_tokens = True
            self._text_backend_copy = backend
        return self._text_backend_copy

    def _cached_longest_token_chars(self, facts_file: Path | None) -> int:
        # Decoding every token takes ~1 s on a 262k vocabulary: read from `facts_file` where it holds it, else
        # computed and written there (a file that cannot be read or written only costs the second).
        if facts_file is not None:
            with suppress(OSError, ValueError, KeyError, TypeError):
                return int(json.loads(facts_file.read_text(encoding="utf-8"))["max_token_chars"])
        longest = self._longest_token_chars()
        if facts_file is not None and facts_file.parent.is_dir():  # beside a cache that was written
            write_json_atomically(facts_file, {"max_token_chars": longest}, "keep the tokenizer's facts")
        return longest

    def _longest_token_chars(self) -> int:
        # A token covers at most its decoded text, or its vocabulary string: for byte-level vocabularies one symbol
        # per byte (a token holding part of a character touches at most one character per byte), for SentencePiece
        # the word with its leading space, which decoding a lone token drops.
        size = self._backend.get_vocab_size(with_added_tokens=True)
        decoded = self._backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        return max(max(map(len, decoded)), max(map(len, self._backend.get_vocab(with_added_tokens=True))))

    def _chars_without_tokens(self) -> tuple[dict[int, None], bool]:
        """What `min_tokens` must not count: the ASCII characters that encode to no token (a byte-level vocabulary
        lacking their byte drops them: SmolLM2's lacks six control bytes), as a `str.translate` table; and whether
        every non-ASCII character yields a token (False if a continuation byte is missing too)."""
        dropped = {b: None for b in range(128) if not self._backend.encode(chr(b), add_special_tokens=False).ids}
        pre = self._backend.pre_tokenizer
        if pre is None or "ByteLevel" not in repr(pre):
            return dropped, True
        vocab = self._backend.get_vocab(with_added_tokens=True)
        # U+0080..U+00BF are C2 80..C2 BF in UTF-8: their second symbols are every continuation byte's.
        continuation = [pre.pre_tokenize_str(chr(c))[0][0][-1] for c in range(0x80, 0xC0)]
        return dropped, all(symbol in vocab for symbol in continuation)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` without tokenizing: no token covers more than `max_token_chars`
        characters, so N characters that each yield a token need at least ceil(N / max_token_chars) tokens."""
        if self._backend.normalizer is not None:  # it could shorten the text (NFC composes characters)
            text = self._backend.normalizer.normalize_str(text)
        dropped_ascii, count_non_ascii = self._uncounted
        if not count_non_ascii:
            text = text.encode("ascii", "ignore").decode()
        return -(-len(text.translate(dropped_ascii)) // self.max_token_chars)

    def encode(self, text: str) -> list[int]:
        """The tokens of a caller's whole text; special-token text in it is the special token."""
        return _encode(self._backend, text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Renders with the chat template, the model's own or the one given to `load` (transformers runs it in a
        sandboxed jinja2, on `renderer`), with `tools` (OpenAI's function definitions) for templates that show them.
        NoChatTemplate if there is neither, UnsupportedChatTemplate if it loads other templates."""
        if not self.hf.chat_template:
            raise NoChatTemplate()
        check_self_contained(self.hf.chat_template, "the chat template")
        return self.renderer.render(messages, tools, add_generation_prompt)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> ChatText:
        """A conversation under the chat template, with the generation prompt, ready for `encode_chat`. A message's
        content may be a TokenSplice."""
        # Special-token text inside messages and tools, and each splice, is swapped for a stand-in the template
        # passes through as it is, so that after rendering every special-token text left is the template's own.
        stand_in = f"\x00{secrets.token_hex(8)}:"
        originals: list[str | TokenSplice] = []

        def swap(found: re.Match | TokenSplice) -> str:
            originals.append(found if isinstance(found, TokenSplice) else found.group())
            return f"{stand_in}{len(originals) - 1}\x00"

        def escape(value):
            if isinstance(value, TokenSplice):
                return swap(value)
            if isinstance(value, str):
                return self._special_text.sub(swap, value) if self._special_text is not None else value
            if isinstance(value, dict):
                return {k: escape(v) for k, v in value.items()}
            return [escape(v) for v in value] if isinstance(value, list) else value

        rendered = self.apply_chat_template(escape(messages), tools=escape(tools) if tools else None)
        if not originals:
            return ChatText(rendered)
        return self._cut_at_markers(rendered, re.compile(re.escape(stand_in) + "([0-9]+)\x00"), originals)

    def _cut_at_markers(self, rendered: str, stand_ins: re.Pattern, originals: list[str | TokenSplice]) -> ChatText:
        pieces: list[ChatPiece] = []
        text: list[str] = []
        pos = 0
        specials = f"|{self._special_text.pattern}" if self._special_text is not None else ""
        for found in re.finditer(f"{stand_ins.pattern}{specials}", rendered):
            text.append(rendered[pos:found.start()])
            pos = found.end()
            original = originals[int(found.group(1))] if found.group(1) is not None else None
            if isinstance(original, str):  # a message's own special-token text: text again
                text.append(original)
                continue
            pieces.append(ChatPiece("".join(text)))
            text = []
            if original is None:
                pieces.append(ChatPiece(found.group(), special=True))
            else:
                pieces.append(ChatPiece(original.text, token_ids=original.token_ids))
        pieces.append(ChatPiece("".join(text + [rendered[pos:]])))
        return ChatText("".join(piece.text for piece in pieces), tuple(pieces))

    def encode_chat(self, chat: ChatText) -> list[int]:
        """The tokens of a rendered conversation: the template's markers are special tokens, message text is text.
        Nothing is added around them (no BOS): a template writes its own, as Hugging Face's and vLLM's chat
        tokenization assume."""
        if chat.pieces is None:  # no message holds special-token text: exactly the tokens of the whole text
            return _encode(self._backend, chat.text, add_special_tokens=False).ids
        # Tokenized piece by piece, cut where the tokenizer itself cuts (at special tokens) and at the splices.
        token_ids: list[int] = []
        for piece in chat.pieces:
            if piece.token_ids is not None:
                token_ids += piece.token_ids
            elif piece.text:
                backend = self._backend if piece.special else self._text_backend
                token_ids += _encode(backend, piece.text, add_special_tokens=False).ids
        return token_ids

    # --- for outside clients: vLLM's add_special_tokens, token strings, a Hugging Face directory ---------------

    def post_processor_additions(self) -> tuple[list[int], list[int]]:
        """The token ids the tokenizer's post-processing adds before and after a single text (a BOS, an EOS):
        what `add_special_tokens=True` adds over `False`. Empty lists for a model that adds none (SmolLM2)."""
        bare = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        start = next(i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare)
        return full[:start], full[start + len(bare):]

    def without_additions(self, token_ids: list[int]) -> list[int]:
        """`token_ids` (from `encode` or `encode_chat`) as `add_special_tokens=False` would have given them: the
        post-processor's additions at either end dropped."""
        before, after = self.post_processor_additions()
        if before and token_ids[:len(before)] == before:
            token_ids = token_ids[len(before):]
        if after and token_ids[len(token_ids) - len(after):] == after:
            token_ids = token_ids[:len(token_ids) - len(after)]
        return token_ids

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's vocabulary string (byte-level symbols such as `Ġthe`), as HF's `convert_ids_to_tokens`."""
        return [self._backend.id_to_token(i) for i in token_ids]

    def tokenizer_config(self, model_max_length: int) -> dict:
        """The tokenizer's `tokenizer_config.json`, for the tokenizer.json this tokenizer serializes to: its special
        tokens, every added token and the chat template. The class is PreTrainedTokenizerFast, which transformers 4
        and 5 both build from tokenizer.json alone (the class transformers 5 saves, TokenizersBackend, is unknown to
        4). No `add_bos_token`: transformers 5 would rebuild the post-processor from it instead of keeping ours."""
        added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                          "single_word": t.single_word, "special": t.special}
                 for i, t in sorted(self._backend.get_added_tokens_decoder().items())}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                  "clean_up_tokenization_spaces": False,  # our decode never cleans up spaces
                  **self.special_tokens_map(), "added_tokens_decoder": added}
        if self.hf.chat_template:
            config["chat_template"] = self.hf.chat_template
        return config

    def special_tokens_map(self) -> dict[str, str | None]:
        """The named special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`), None where the model has
        none."""
        return {name: getattr(self.hf, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def export(self, directory: Path, model_max_length: int) -> list[Path]:
        """Writes the tokenizer as a Hugging Face directory (tokenizer.json, tokenizer_config.json with the chat
        template, special_tokens_map.json) that `AutoTokenizer.from_pretrained` loads and that encodes exactly as
        `encode`. Returns the files written."""
        directory.mkdir(parents=True, exist_ok=True)
        # A fresh copy, so that no padding or truncation a caller set on the live tokenizer is written.
        backend = RustTokenizer.from_str(self._backend.to_str())
        backend.no_padding()
        backend.no_truncation()
        files = {"tokenizer.json": backend.to_str(pretty=True),
                 "tokenizer_config.json": json.dumps(self.tokenizer_config(model_max_length), indent=2,
                                                     ensure_ascii=False),
                 "special_tokens_map.json": json.dumps(
                     {k: v for k, v in self.special_tokens_map().items() if v is not None}, indent=2,
                     ensure_ascii=False)}
        for name, text in files.items():
            (directory / name).write_text(text + "\n", encoding="utf-8")
        return [directory / name for name in files]


def _encode(backend: RustTokenizer, text: str, add_special_tokens: bool) -> Encoding:
    """`backend.encode(text)`, with the GIL released while it runs (tokenizers releases it in `encode_batch` only):
    a long prompt tokenized on a preparation thread then stalls neither the event loop nor the engine thread."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
