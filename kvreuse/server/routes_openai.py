"""OpenAI's routes: `/v1/completions`, `/v1/chat/completions` (API key required when configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kvreuse.server.auth import TenantDep, authenticate
from kvreuse.server.prompts import chat_prompt, check_model, completion_prompts, off_loop
from kvreuse.server.protocol import ChatCompletionRequest, CompletionRequest
from kvreuse.server.responses import respond
from kvreuse.server.state import StateDep

router = APIRouter(dependencies=[Depends(authenticate)])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    prompts = await off_loop(completion_prompts, state.engine.front_end, body, tenant)
    return await respond(state, prompts, body, request, tenant, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    prompt, dropped = await off_loop(chat_prompt, state.engine.front_end, body, tenant)
    return await respond(state, [prompt], body, request, tenant, chat=True, truncated_turns=dropped)
