"""The OpenAI wire format (the subset kvreuse serves), as pydantic models.

Every field of OpenAI's completion and chat requests has one of three fates here:
- modelled: kvreuse serves it (`max_tokens`, `stop`, `seed`, `n`, `logprobs`, penalties, `response_format`, ...),
  vLLM's extensions that clients send (`top_k`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `guided_*`,
  `ignore_eos`), OpenAI's session hints (`prompt_cache_key`, `prompt_cache_retention`) and kvreuse's own
  (`cache_salt`, `use_cache`);
- IGNORED: accepted and ignored, because it cannot change the answer (`user`, `metadata`, `store`, ...);
- unsupported (`UNSUPPORTED` of each request): refused with 400 naming the field, unless its value asks for nothing
  (`suffix: ""`, `audio: null`, ...).
A field that is neither OpenAI's nor kvreuse's is refused too, with the closest known name ("did you mean
'max_tokens'?"): a typo silently ignored would answer another request than the one meant. Every error names its field
in `param`; a check of the whole body raises `FieldError` to do so.
"""

from __future__ import annotations

import difflib
import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvreuse.config import MAX_PIN_TTL_S
from kvreuse.sampling_params import MAX_CHOICES, MAX_LOGPROBS, SEED_RANGE
from kvreuse.weights.tokenizer import check_unicode

MAX_BATCHED_PROMPTS = 64  # prompts in one /v1/completions request (each is a sequence, admitted together)

# OpenAI fields that cannot change the answer: accepted, ignored.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prediction"})
# OpenAI fields kvreuse does not implement -> the values besides null that ask for nothing (accepted).
CHAT_UNSUPPORTED = {
    "functions": ([],), "function_call": ("none", "auto"), "audio": (), "modalities": (["text"],),
    "reasoning_effort": (), "verbosity": (), "web_search_options": ()}
COMPLETION_UNSUPPORTED = {"suffix": ("",)}


class FieldError(ValueError):
    """A check of the whole request body that is about one field, named in the error's `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _asks_for_nothing(value: Any, neutral: tuple) -> bool:
    # bool is an int in Python, but `logprobs: 0` is not `false`, nor is `best_of: true` 1.
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _unsupported(field: str, neutral: tuple) -> FieldError:
    verb = "are" if field.endswith("s") else "is"
    allowed = " or ".join(json.dumps(v) for v in (None, *neutral))
    return FieldError(field, f"{field} {verb} not supported by kvreuse (accepted only as {allowed})")


def _unknown(field: str, known: list[str]) -> FieldError:
    close = difflib.get_close_matches(field, known, n=1, cutoff=0.8)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return FieldError(field, f"unknown field {field!r}{hint} (kvreuse refuses fields it does not know rather than "
                             f"ignore them)")


def _check_texts(value: Any) -> Any:
    """Strings, lists of strings and text content parts must be valid Unicode (the tokenizer cannot read the rest)."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        text = item.get("text") if isinstance(item, dict) else item
        if isinstance(text, str):
            check_unicode(text)
    return value


MAX_TOKEN_ID_DIGITS = 10  # token ids are below 2**31; int() of thousands of digits is slow, then refused
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]  # checked for valid Unicode where it is a field


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    model: str | None = None  # the served model when absent, as vLLM and llama.cpp do; another name is a 404
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 only to score a prompt (echo + logprobs)
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None  # OpenAI's newer name; wins over max_tokens
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    seed: Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    ignore_eos: bool = False
    # A session (within the caller's tenant and salt): replicas route by it, and its blocks are retained between its
    # requests (kvcache/retention.py).
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    # kvreuse extensions: narrow cache sharing within the caller's tenant, or opt out of reuse.
    cache_salt: CacheSalt | None = None
    use_cache: bool = True

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic says what it should be
        kept = {}
        for field, value in data.items():
            if field in cls.model_fields:
                kept[field] = value
            elif field in cls.UNSUPPORTED:
                if not _asks_for_nothing(value, cls.UNSUPPORTED[field]):
                    raise _unsupported(field, cls.UNSUPPORTED[field])
            elif field not in IGNORED:
                raise _unknown(field, [*cls.model_fields, *cls.UNSUPPORTED, *IGNORED])
        return kept

    @field_validator("stop", "cache_salt", "prompt_cache_key", mode="before")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        return _check_texts(value)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and not all(key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS for key in bias):
            raise ValueError(f"logit_bias keys must be token ids (decimal strings of at most {MAX_TOKEN_ID_DIGITS} "
                             f"digits, as JSON object keys are)")
        return bias

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or (isinstance(stop, list) and not all(stop)):
            raise ValueError("stop strings must be non-empty")
        return stop

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    # What the request asks of the engine beyond the common fields; each endpoint says it its own way.
    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per generated token, or None for no logprobs."""
        return None

    @property
    def echo_prompt(self) -> bool:
        return False

    @property
    def num_best_of(self) -> int | None:
        return None

    def sampling_options(self) -> dict[str, Any]:
        """The SamplingParams fields these sampling fields set (max_tokens and the guided decoding aside)."""
        logprobs = self.num_logprobs
        return {"temperature": self.temperature, "top_k": max(0, self.top_k), "top_p": self.top_p, "seed": self.seed,
                "stop": self.stop_list, "stop_token_ids": list(self.stop_token_ids or ()),
                "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "n": self.n,
                "best_of": self.num_best_of, "logprobs": logprobs,
                "prompt_logprobs": logprobs if self.echo_prompt else None,
                "presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": self.repetition_penalty or 1.0,
                "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()}}


class CompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = COMPLETION_UNSUPPORTED

    # One prompt (text or token ids) or a batch of them (texts or token-id lists): one choice per prompt and n.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _valid_prompt_text(cls, value: Any) -> Any:
        return _check_texts(value)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int] | list[str] | list[list[int]]):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_BATCHED_PROMPTS:
                raise ValueError(f"at most {MAX_BATCHED_PROMPTS} prompts per request, got {len(prompt)}")
            if not all(prompt):
                raise ValueError("prompt: every prompt of the batch must be non-empty")
        return prompt

    @model_validator(mode="after")
    def _streamable(self):
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise FieldError("best_of", "best_of > n cannot stream: the best choices are known only at the end")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (a single prompt is a batch of one)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], str | list) else [p]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        return self.echo

    @property
    def num_best_of(self) -> int | None:
        return self.best_of


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call an assistant message carries (the client echoes the calls the server answered with)."""
    model_config = ConfigDict(extra="ignore")

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[MessageToolCall] | None = None   # assistant messages
    tool_call_id: str | None = None                   # tool messages: the call they answer

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool calls, not {self.role} messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        return self

    def as_dict(self) -> dict:
        """The message as the chat template and the tool conversation take it: role, text content, and the tool
        fields it has."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        return _check_texts(value)

    def text(self) -> str:
        """Content as text; a list of parts may only hold text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("messages: only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = CHAT_UNSUPPORTED

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None                    # checked by kvreuse.tools.request, naming the field
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class _PromptOrMessages(BaseModel):
    """A body with exactly one of `prompt` (its type declared by the subclass) or `messages`."""

    messages: list[ChatMessage] | None = None

    @field_validator("prompt", mode="before", check_fields=False)
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        return _check_texts(value)

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" or "messages"')
        return self


class TokenizeRequest(_PromptOrMessages):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None


class WarmItem(_PromptOrMessages):
    """One thing to warm: a raw prompt (text or token ids) or a conversation, under an optional cache salt."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[Annotated[int, Field(ge=0)]] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    cache_salt: CacheSalt | None = None

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _valid_salt(cls, value: Any) -> Any:
        return _check_texts(value)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int] | None) -> str | list[int] | None:
        if prompt is not None and len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt


class WarmRequest(BaseModel):
    """`POST /cache/warm`: documents, system prompts, few-shot blocks to compute and keep before users ask."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    items: list[WarmItem] = Field(min_length=1, max_length=1024)
    # Hold each item's cached prefix in the pool (kvcache/pins.py), within cache.pin_max_share of it, for pin_ttl_s
    # seconds (default cache.pin_ttl_s; 0: until POST /cache/unpin).
    pin: bool = False
    pin_ttl_s: int | None = None

    @field_validator("pin_ttl_s", mode="before")
    @classmethod
    def _whole_seconds(cls, value: Any) -> Any:
        if value is None or (type(value) is int and 0 <= value <= MAX_PIN_TTL_S):
            return value
        got = "" if type(value) is int else f", got {type(value).__name__} {value!r:.32}"
        raise ValueError(f"pin_ttl_s must be an integer number of seconds from 0 to {MAX_PIN_TTL_S} (30 days; 0: "
                         f"until POST /cache/unpin){got}")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
