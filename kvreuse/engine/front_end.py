"""The request-preparation half of the engine: normalize, tokenize, validate, make the Sequence.

It needs the resolved model (resolved_model.py: shape, fingerprint, dtype, KV layout), its tokenizer and the pool
size, never its weights: the LLMEngine builds one (its `front_end`), and an ingress that never runs the model builds
one from the same ResolvedModel (`FrontEnd.from_config`), so both prepare a request, and key its blocks, exactly
alike.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
from jinja2 import TemplateError

from kvreuse.config import Config
from kvreuse.config.chat_template import UnsupportedChatTemplate
from kvreuse.engine.errors import RequestError, check_text
from kvreuse.engine.resolved_model import ResolvedModel, resolve_model
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.normalize import normalize_text
from kvreuse.kvcache.request import new_cache_request
from kvreuse.sampling_params import SamplingParams
from kvreuse.tools.parsers import ToolParser, detect_format, get_parser
from kvreuse.tools.turns import TurnStore
from kvreuse.weights import validate
from kvreuse.weights.chat_render import ChatTemplateFailed, ChatTemplateLimit
from kvreuse.weights.chat_template import NoChatTemplate
from kvreuse.weights.tokenizer import ChatText, Tokenizer, check_unicode

if TYPE_CHECKING:
    from kvreuse.structured import CheckedFormat, FormatSpec, GrammarCompiler
    from kvreuse.structured.unavailable import NoGrammarEngine

logger = logging.getLogger(__name__)

RETENTIONS = (None, "in_memory", "in-memory", "24h")  # OpenAI's prompt_cache_retention (the JS SDK sent "in-memory")
RETENTION_24H_S = 86_400.0


class FrontEnd:
    """Prepares requests for one model in one dtype; touches no engine state, so any thread may use it."""

    def __init__(self, config: Config, resolved: ResolvedModel, *, compiles_grammars: bool = True):
        """The front end of `resolved`, the model `resolve_model(config)` resolved; it resolves nothing again."""
        self.config = config
        # False where no model runs (a cluster's ingress): response formats are checked here, compiled by replicas.
        self.compiles_grammars = compiles_grammars
        self.resolved = resolved
        self.model_path, self.model_args = resolved.path, resolved.args
        self.dtype, self.dtype_description = resolved.dtype, resolved.dtype_description
        self.weights, self.fingerprint, self.kv_layout = resolved.weights, resolved.fingerprint, resolved.kv_layout
        self.tokenizer = Tokenizer.load(resolved.path, resolved.info.fingerprint, config.model.chat_template or None)
        validate.check_tokenizer(resolved.path, len(self.tokenizer.hf), resolved.args.vocab_size)
        self.block_size = config.cache.block_size
        self.bytes_per_block = resolved.kv_bytes_per_block(self.block_size)
        # Usable blocks; a budget in memory also covers the pool's null block (block_pool.py).
        self.num_kv_blocks = config.engine.num_kv_blocks or max(1, config.engine.kv_cache_memory_mb * 2**20
                                                                // self.bytes_per_block - 1)
        self.max_model_len = min(config.server.max_tokens, resolved.args.max_position_embeddings)
        # Sampling of requests that bring no seed of their own draws from here: a run is reproducible.
        self.generator = torch.Generator().manual_seed(config.engine.seed)
        self._request_counter = itertools.count()
        self.tool_turns = TurnStore()  # tool-call turns generated here, spliced back in when a client echoes them

    @classmethod
    def from_config(cls, config: Config) -> FrontEnd:
        """The front end of `config`'s model alone (`resolve_model`), for a process that runs no model. Its `config`
        names what was resolved (`ResolvedModel.config_of`), so that engines built from it (a cluster's replicas)
        load the same weights in the same dtype, and key their blocks alike. It only checks response formats
        (`compiles_grammars` False): the replica that runs a sequence compiles its grammar. ModelLoadError for a bad
        model path."""
        resolved = resolve_model(config)
        return cls(resolved.config_of(config), resolved, compiles_grammars=False)

    @functools.cached_property
    def kv_capacity_tokens(self) -> int:
        """The longest sequence the pool holds (with a grouped layout, its window groups hold what a step writes and
        reads, at most `engine.max_num_batched_tokens` new tokens a step)."""
        layout, bs, step = self.kv_layout, self.block_size, self.config.engine.max_num_batched_tokens
        fits = lambda num_blocks: layout.max_blocks_of(num_blocks * bs, bs, step) <= self.num_kv_blocks  # noqa: E731
        low, high = 0, self.num_kv_blocks  # group 0's blocks: the most whose sequence fits is in [low, high]
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low * bs

    def describe_kv(self) -> str:
        """The pool's shape, for the ready line: blocks and, with groups, what they hold."""
        grouped = f"; {self.kv_layout.describe()}" if self.kv_layout.is_grouped else ""
        return (f"{self.kv_capacity_tokens} tokens ({self.num_kv_blocks} blocks x {self.block_size}, "
                f"{self.resolved.kv_format.name}{grouped})")

    def normalize(self, text: str) -> str:
        return normalize_text(text) if self.config.cache.normalize_input else text

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation (what `tokenize_chat` tokenizes); with normalize_input, each message
        is normalized first."""
        return self._chat_text(messages, tools).text

    @functools.cached_property
    def tool_parser_name(self) -> str:
        """The tool-call format: `model.tool_call_parser`, or (auto) the one the chat template shows."""
        name = self.config.model.tool_call_parser
        return detect_format(self.tokenizer.hf.chat_template) if name == "auto" else name

    def tool_parser(self, tool_names: Collection[str]) -> ToolParser:
        """A parser of this model's tool-call format that knows `tool_names`."""
        return get_parser(self.tool_parser_name, tool_names)

    def _chat_text(self, messages: list[dict], tools: list[dict] | None = None) -> ChatText:
        messages = [{**m, "content": self.normalize(m["content"])} if isinstance(m.get("content"), str) else m
                    for m in messages]
        try:
            return self.tokenizer.render_chat(messages, tools)
        except NoChatTemplate as exc:
            raise RequestError(f"messages: {exc}", "messages", "no_chat_template") from None
        except UnsupportedChatTemplate as exc:
            raise RequestError(f"messages: {exc}", "messages", "unsupported_chat_template") from None
        except (TemplateError, ChatTemplateFailed) as exc:  # its raise_exception, e.g. roles that do not alternate
            raise RequestError(f"messages: the chat template refused the conversation: {exc}", "messages") from None
        except ChatTemplateLimit as exc:
            raise RequestError(f"messages: {exc}", "messages", "chat_template_limit") from None

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt tokens of a conversation under the chat template: only the template's own markers become
        special tokens; text inside a message is text, so it cannot forge a role or end a turn. RequestError
        (field `messages`) for invalid Unicode and for a prompt too long by its character count alone."""
        chat = self._chat_text(messages, tools)
        self._check_text(chat.text, "messages")
        return self.tokenizer.encode_chat(chat)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """The tokens of a raw prompt: a text is the caller's whole text (special-token text in it is the special
        token; a conversation goes through `tokenize_chat`), token ids are checked against the vocabulary.
        RequestError (field `prompt`) for invalid Unicode and for a text too long by its character count alone."""
        if isinstance(prompt, str):
            text = self.normalize(prompt)
            self._check_text(text, "prompt")
            return self.tokenizer.encode(text)
        if not all(isinstance(t, int) and 0 <= t < self.model_args.vocab_size for t in prompt):
            raise RequestError(f"prompt token ids must be integers in [0, {self.model_args.vocab_size})")
        return list(prompt)

    def _check_text(self, text: str, field: str) -> None:
        """Before tokenizing: valid Unicode, and not so many characters that the tokens alone fill the context.
        Tokenizing costs about a second and hundreds of MB per million characters; these checks, one scan."""
        try:
            check_unicode(text)
        except ValueError as exc:
            raise RequestError(f"{field}: {exc}", field) from None
        least = self.tokenizer.min_tokens(text)
        if least >= self.max_model_len:  # not even one completion token would fit
            rendered = " (rendered with the chat template)" if field == "messages" else ""
            raise RequestError(
                f"{field}: {len(text):,} characters{rendered} need at least {least:,} tokens (no token of this model "
                f"covers more than {self.tokenizer.max_token_chars} characters), which leaves no room for a "
                f"completion within the context limit of {self.max_model_len} tokens (server.max_tokens)", field,
                "context_length_exceeded")

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, *, cache_salt: str | None = None,
                      use_cache: bool = True, response_format: FormatSpec | CheckedFormat | None = None,
                      session_key: str | None = None, retention: str | None = None) -> Sequence:
        """Tokenize and validate a request without touching engine state (safe from any thread); raises
        RequestError naming the problem. Requests with different `cache_salt` never share KV;
        `use_cache=False` opts out of reuse. `response_format` (kvreuse.structured.parse_format) constrains what
        every choice generates; its grammar is compiled here, or only checked where `compiles_grammars` is False
        (UnsupportedFormat, naming the field and any limit's key, if it is refused). `session_key` (OpenAI's
        `prompt_cache_key`) names the request's session, whose blocks are retained after it ends
        (`cache.session_retention_s`, or a day for `retention` "24h"; kvcache/retention.py)."""
        for field, text in (("cache_salt", cache_salt), ("prompt_cache_key", session_key)):
            if text is not None:
                check_text(field, text)
        if retention not in RETENTIONS:
            raise RequestError(f"prompt_cache_retention must be one of {', '.join(map(str, RETENTIONS))}, got "
                               f"{retention!r}", "prompt_cache_retention")
        params = params or SamplingParams(max_tokens=self.config.server.default_max_tokens)
        self._check_stops(params.stop)
        out_of_range = params.token_ids_in_range(self.model_args.vocab_size)
        if out_of_range:
            raise RequestError(f"{out_of_range}: token ids must be in [0, {self.model_args.vocab_size})", out_of_range)
        if params.max_tokens == 0 and params.num_sequences > 1:
            raise RequestError("n: a request that only scores its prompt (max_tokens 0) has one choice", "n")
        token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise RequestError("prompt is empty")
        self.check_fits(len(token_ids), params.max_tokens)
        request_id = request_id or f"req-{next(self._request_counter)}"
        kv = new_cache_request(list(token_ids), self.fingerprint, self.block_size, cache_salt=cache_salt,
                               use_cache=use_cache, prompt_logprobs=params.prompt_logprobs, session_key=session_key,
                               retention_s=self.retention_s(retention))
        grammar = None
        if response_format is not None:
            grammar = (self.grammars.compile if self.compiles_grammars else self.grammars.check)(response_format)
        seq = Sequence(request_id, kv, params, grammar=grammar)
        seq.generator = seq.generator or self.generator
        seq.cache_salt = cache_salt
        seq.session_key, seq.retention = session_key, retention
        return seq

    def retention_s(self, retention: str | None) -> float:
        """Seconds a session's blocks are retained for a request's `prompt_cache_retention` (none with
        `cache.session_retention_s` = 0)."""
        configured = self.config.cache.session_retention_s
        return RETENTION_24H_S if retention == "24h" and configured else configured

    @functools.cached_property
    def grammars(self) -> GrammarCompiler | NoGrammarEngine:
        """The compiler of response formats for this tokenizer (built at the first request that asks for one); without
        xgrammar, one that refuses every format, naming the command that installs it."""
        from kvreuse.structured.errors import engine_missing

        missing = engine_missing()  # imports xgrammar
        if missing:
            from kvreuse.structured.unavailable import NoGrammarEngine

            logger.warning("response formats and tool grammars will be refused: %s", missing)
            return NoGrammarEngine(missing)
        from kvreuse.structured import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.model_args.vocab_size, self.config.structured)

    def close(self) -> None:
        """Stop the grammar check process, if a request started one."""
        if "grammars" in self.__dict__:  # built (cached_property): nothing to stop otherwise
            self.grammars.close()

    def _check_stops(self, stops: list[str]) -> None:
        # Every step searches the new text for every stop string: their number and length bound that work.
        limits = self.config.server
        if len(stops) > limits.max_stop_strings:
            raise RequestError(f"stop: {len(stops)} stop strings, at most {limits.max_stop_strings} allowed "
                               f"(server.max_stop_strings)", "stop")
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_chars:
            raise RequestError(f"stop: a stop string of {longest} characters, at most {limits.max_stop_chars} "
                               f"allowed (server.max_stop_chars)", "stop")

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        needed = num_prompt_tokens + max_tokens
        if needed > self.max_model_len:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {needed} tokens exceeds "
                f"the context limit of {self.max_model_len} tokens (server.max_tokens)", code="context_length_exceeded"
            )
        if needed > self.kv_capacity_tokens:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {needed} tokens does not fit "
                f"in the KV pool of {self.kv_capacity_tokens} tokens (engine.num_kv_blocks x cache.block_size"
                f"{', sliding windows kept as cache.sliding_kv says' if self.kv_layout.is_grouped else ''})"
            )
