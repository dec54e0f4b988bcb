"""From a validated request body to what the engine runs: model check, chat prompt, Sequence.

Everything here runs on the event loop and never touches engine state (tokenizing and
`LLMEngine.make_sequence` are pure); problems become 400/404 APIErrors naming the field.
"""

from __future__ import annotations

from kvreuse.engine.engine import LLMEngine, RequestError
from kvreuse.engine.sequence import Sequence
from kvreuse.sampling_params import SamplingParams
from kvreuse.server.errors import APIError
from kvreuse.server.protocol import ChatCompletionRequest, ChatMessage, SamplingFields, make_id


def check_model(served: str, requested: str | None) -> None:
    """404 unless the request names the served model (or, where optional, none)."""
    if requested is not None and requested != served:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {served!r}",
                       "NotFoundError", "model", "model_not_found")


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as the `{"role", "content"}` dicts the chat template takes."""
    try:
        return [{"role": m.role, "content": m.text()} for m in messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc


def render_chat(engine: LLMEngine, messages: list[dict]) -> str:
    """The model's chat template applied to `messages`."""
    try:
        return engine.render_chat(messages)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc


def make_sequence(engine: LLMEngine, prompt: str | list[int], body: SamplingFields, tenant: str | None) -> Sequence:
    """The Sequence for `prompt` under the body's sampling fields, salted by the tenant; 400 if it cannot run
    (over the context limit, bad token ids, bad sampling values)."""
    # A tenant's salt can only be narrowed by the request's own field, never replaced.
    salt = body.cache_salt if tenant is None else f"{tenant}\x00{body.cache_salt or ''}"
    try:
        token_ids = engine.tokenize_prompt(prompt)
        max_tokens = body.max_tokens
        if max_tokens is None:
            room = engine.max_model_len - len(token_ids)
            max_tokens = max(1, min(engine.config.server.default_max_tokens, room))
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                                top_k=max(0, body.top_k), top_p=body.top_p, seed=body.seed,
                                stop=body.stop_list, ignore_eos=body.ignore_eos)
        return engine.make_sequence(token_ids, params, make_id("req"), cache_salt=salt, use_cache=body.use_cache)
    except RequestError as exc:
        raise APIError(400, str(exc), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded" if "exceeds" in str(exc) else None) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
