"""vLLM's `/tokenize` and `/detokenize` (API key required when configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from kvreuse.server.auth import authenticate
from kvreuse.server.errors import APIError
from kvreuse.server.prompts import check_model, off_loop, tokenize_body
from kvreuse.server.protocol import DetokenizeRequest, TokenizeRequest
from kvreuse.server.state import StateDep

router = APIRouter(dependencies=[Depends(authenticate)])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep):
    check_model(state.model_name, body.model)
    tokens = await off_loop(tokenize_body, state.engine, body)
    return {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep):
    check_model(state.model_name, body.model)
    vocab = state.engine.model_args.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens")
    return {"prompt": await off_loop(state.engine.tokenizer.decode, body.tokens, False)}
