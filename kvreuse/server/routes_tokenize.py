"""vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info` (API key required when configured): what clients such as
lm-evaluation-harness (its `tokenizer_backend=remote`) use instead of downloading the tokenizer."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kvreuse.engine.front_end import FrontEnd
from kvreuse.server.auth import TenantDep, authenticate
from kvreuse.server.errors import APIError
from kvreuse.server.json_route import FastJSONRoute
from kvreuse.server.prompts import check_model, tokenize_body
from kvreuse.server.protocol import DetokenizeRequest, TokenizeRequest
from kvreuse.server.state import StateDep

router = APIRouter(dependencies=[Depends(authenticate)], route_class=FastJSONRoute)


class TokenizeBody(TokenizeRequest):
    """vLLM's request fields beside ours. `add_special_tokens: false` drops what the tokenizer's post-processing
    adds to a prompt (a BOS, an EOS; special-token text in a prompt is still the special token, as in vLLM and HF).
    Chat tokens never get those additions (the template writes its own BOS), so for messages both values give the
    tokens a chat request gets."""
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


def _tokenize(front: FrontEnd, body: TokenizeBody) -> dict:
    tokens = tokenize_body(front, body)
    if not body.add_special_tokens and body.messages is None:
        tokens = front.tokenizer.without_additions(tokens)
    return {"count": len(tokens), "max_model_len": front.max_model_len, "tokens": tokens,
            "token_strs": front.tokenizer.token_strings(tokens) if body.return_token_strs else None}


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    return await state.preparation.run(tenant, request, _tokenize, state.engine.front_end, body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    front = state.engine.front_end
    vocab = front.model_args.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens")
    return {"prompt": await state.preparation.run(tenant, request, front.tokenizer.decode, body.tokens, False)}


@router.get("/tokenizer_info")
async def tokenizer_info(state: StateDep):
    """vLLM's shape: the tokenizer_config.json of the served tokenizer (`tokenizer_class`, the special tokens,
    `chat_template`, `added_tokens_decoder`), with `model_max_length` the server's context limit."""
    front = state.engine.front_end
    config = front.tokenizer.tokenizer_config(front.max_model_len)
    # vLLM gives each added token's text only, not HF's object of flags.
    config["added_tokens_decoder"] = {i: token["content"] for i, token in config["added_tokens_decoder"].items()}
    return {**config, "name_or_path": state.model_name}
