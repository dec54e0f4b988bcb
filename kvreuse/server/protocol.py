"""The OpenAI wire format (the subset kvreuse serves), as pydantic models.

Unknown fields are ignored, as OpenAI-compatible servers do; known fields that kvreuse cannot honour
(n > 1, logprobs, tools, ...) are refused with an error naming them rather than silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1
    logprobs: bool | int | None = None
    ignore_eos: bool = False
    # kvreuse extensions: narrow cache sharing within the caller's tenant, or opt out of reuse.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    use_cache: bool = True

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.n != 1:
            raise ValueError("n > 1 is not supported; send separate requests")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if isinstance(self.stop, list) and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (a list of several strings is not supported)")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """Content as text; a list of parts may only hold text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("messages: only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict] | None = None

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.tools:
            raise ValueError("tools are not supported")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" or "messages"')
        return self


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
