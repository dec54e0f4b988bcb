"""vLLM's `/tokenize` and `/detokenize` (API key required when configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from kvreuse.server.auth import authenticate
from kvreuse.server.errors import APIError
from kvreuse.server.prompts import check_model, message_dicts, render_chat
from kvreuse.server.protocol import DetokenizeRequest, TokenizeRequest
from kvreuse.server.state import StateDep

router = APIRouter(dependencies=[Depends(authenticate)])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep):
    check_model(state.model_name, body.model)
    engine = state.engine
    text = body.prompt if body.prompt is not None else render_chat(engine, message_dicts(body.messages))
    tokens = engine.tokenize_prompt(text)
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep):
    check_model(state.model_name, body.model)
    vocab = state.engine.model_args.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens")
    return {"prompt": state.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
