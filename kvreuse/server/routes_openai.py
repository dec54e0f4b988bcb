"""OpenAI's routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (API key required when configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kvreuse.server.auth import TenantDep, authenticate
from kvreuse.server.prompts import chat_sequence, check_model, completion_sequence, off_loop
from kvreuse.server.protocol import ChatCompletionRequest, CompletionRequest
from kvreuse.server.responses import respond
from kvreuse.server.state import StateDep

router = APIRouter(dependencies=[Depends(authenticate)])


@router.get("/v1/models")
async def list_models(state: StateDep):
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvreuse",
        "max_model_len": state.engine.max_model_len}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    seq = await off_loop(completion_sequence, state.engine, body, tenant)
    return await respond(state, seq, body, request, tenant, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    seq, dropped = await off_loop(chat_sequence, state.engine, body, tenant)
    return await respond(state, seq, body, request, tenant, chat=True, truncated_turns=dropped)
