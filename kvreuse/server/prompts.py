"""From a validated request body to what the engine runs: model check, chat prompt, Sequence.

Rendering the chat template, tokenizing and `FrontEnd.make_sequence` (which compiles a response format's grammar)
run on the preparation threads, shared fairly between tenants (preparation.py), never on the event loop: a prompt of
megabytes delays no other route, /health included. None of them touches engine state. Problems become 400/404
APIErrors naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvreuse.engine.errors import RequestError
from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.hashing import scoped_salt
from kvreuse.sampling_params import InvalidSamplingParam, SamplingParams
from kvreuse.server.errors import APIError
from kvreuse.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TokenizeRequest,
    make_id,
)
from kvreuse.server.responses import Prompt
from kvreuse.server.tool_answers import ToolAnswers
from kvreuse.server.truncation import fit_conversation
from kvreuse.structured.errors import UnsupportedFormat
from kvreuse.tools.conversation import template_messages
from kvreuse.tools.request import ToolError, ToolRequest, parse_tool_request

if TYPE_CHECKING:
    from kvreuse.structured import FormatSpec

def check_model(served: str, requested: str | None) -> None:
    """404 unless the request names the served model (or, where optional, none)."""
    if requested is not None and requested != served:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {served!r}",
                       "NotFoundError", "model", "model_not_found")


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as dicts: `{"role", "content"}` and the tool fields a message has."""
    try:
        return [m.as_dict() for m in messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc


def refusal(exc: RequestError, chat: bool) -> APIError:
    """The engine's refusal as a 400 naming the field; a chat's prompt is its `messages`."""
    field = "messages" if chat and exc.field == "prompt" else exc.field
    return APIError(400, str(exc), param=field, code=exc.code)


def completion_prompts(front: FrontEnd, body: CompletionRequest, tenant: str | None) -> list[Prompt]:
    """The prompts of a /v1/completions body (one, or a batch): each is the caller's whole text (or token ids)."""
    prompts = []
    for prompt in body.prompts:
        seq = _sequence(front, lambda p=prompt: front.tokenize_prompt(p), body, tenant, chat=False)
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else front.tokenizer.decode(prompt, skip_special_tokens=False)
        prompts.append(Prompt(seq, echo))
    return prompts


def chat_prompt(front: FrontEnd, body: ChatCompletionRequest, tenant: str | None) -> tuple[Prompt, int]:
    """The prompt of a /v1/chat/completions body, and how many turns `server.truncate = oldest` dropped."""
    tools = tool_request(body)
    salt = scoped_salt(tenant, body.cache_salt)
    parser = front.tool_parser(tools.names if tools else ())
    try:
        messages, definitions = template_messages(message_dicts(body.messages), tools, parser,
                                                  front.tool_parser_name != "json", front.tool_turns, salt)
        tool_grammar = tool_grammar_of(tools, front.tool_parser_name)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc
    if tool_grammar is not None and structured_format(body) is not None:
        raise APIError(400, "response_format: a request whose tool_choice constrains the answer (auto, required or a "
                            "named tool) takes no response format", param="response_format")
    dropped = 0
    try:
        if front.config.server.truncate == "oldest":
            messages, dropped = fit_conversation(front, messages, body.max_tokens, definitions)
    except RequestError as exc:
        raise refusal(exc, chat=True) from exc
    seq = _sequence(front, lambda: front.tokenize_chat(messages, definitions), body, tenant, chat=True,
                    response_format=tool_grammar)
    answers = None
    if tools is not None:
        answers = ToolAnswers(tools, parser, front.tool_turns, salt, front.tokenizer.eos_token_ids)
    return Prompt(seq, tools=answers), dropped


def tool_grammar_of(tools: ToolRequest | None, format_name: str) -> FormatSpec | None:
    """The grammar a tool request's choice asks for, in the model's tool-call format, or None."""
    if tools is None:
        return None  # xgrammar is imported only for requests with tools
    from kvreuse.tools.grammar import tool_format

    return tool_format(tools, format_name)


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """The body's tools and tool choice, checked (400 naming the field)."""
    try:
        return parse_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc


def may_compile(body: SamplingFields) -> bool:
    """Preparing `body` may compile a grammar: it asks for an output format, or offers tools the model may call."""
    asks_format = any(field is not None for field in (body.response_format, body.guided_json, body.guided_regex,
                                                       body.guided_choice))
    return asks_format or (bool(getattr(body, "tools", None)) and getattr(body, "tool_choice", None) != "none")


def structured_format(body: SamplingFields) -> FormatSpec | None:
    """The output format the body asks for (response_format or vLLM's guided_*), or None."""
    if body.response_format is None and body.guided_json is None and body.guided_regex is None \
            and body.guided_choice is None:
        return None  # xgrammar is imported only for requests that ask for a format
    from kvreuse.structured import parse_format

    return parse_format(body.response_format, body.guided_regex, body.guided_choice, body.guided_json)


def tokenize_body(front: FrontEnd, body: TokenizeRequest) -> list[int]:
    """The tokens of a /tokenize body, exactly as a completion or chat request would get them."""
    chat = body.messages is not None
    try:
        return front.tokenize_chat(message_dicts(body.messages)) if chat else front.tokenize_prompt(body.prompt)
    except RequestError as exc:
        raise refusal(exc, chat) from exc


def _sequence(front: FrontEnd, tokenize: Callable[[], list[int]], body: SamplingFields, tenant: str | None,
              chat: bool, response_format: FormatSpec | None = None) -> Sequence:
    """The Sequence for the tokens `tokenize` gives under the body's sampling fields, salted by the tenant; 400
    if it cannot run (over the context limit, bad token ids or text, bad sampling values, too many stops)."""
    # A tenant's salt can only be narrowed by the request's own field, never replaced, nor sent by a keyless caller.
    salt = scoped_salt(tenant, body.cache_salt)
    try:
        token_ids = tokenize()
        max_tokens = body.max_tokens
        if max_tokens is None:
            room = front.max_model_len - len(token_ids)
            max_tokens = max(1, min(front.config.server.default_max_tokens, room))
        params = SamplingParams(max_tokens=max_tokens, **body.sampling_options())
        response_format = response_format or structured_format(body)
        return front.make_sequence(token_ids, params, make_id("req"), cache_salt=salt, use_cache=body.use_cache,
                                   response_format=response_format, session_key=body.prompt_cache_key,
                                   retention=body.prompt_cache_retention)
    except RequestError as exc:
        raise refusal(exc, chat) from exc
    except UnsupportedFormat as exc:
        raise APIError(400, str(exc), param=exc.field) from exc
    except InvalidSamplingParam as exc:
        field = exc.field
        if field == "max_tokens" and body.max_completion_tokens is not None:  # the name the caller used
            field = "max_completion_tokens"
        raise APIError(400, f"{field}: {exc}" if field != exc.field else str(exc), param=field) from exc
