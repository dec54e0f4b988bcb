"""OpenAI's routes: `/v1/completions`, `/v1/chat/completions` (API key required when configured).

A request's places in the queue (its sequences: prompts x n) are reserved before it is prepared, so a tenant at
its share gets 429 before its prompts are tokenized or its grammar compiled; it is then prepared on its tenant's
turn of the preparation threads (preparation.py), and dropped there if its client has gone.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kvreuse.server.admission import request_sequences, reserve
from kvreuse.server.auth import TenantDep, authenticate
from kvreuse.server.json_route import FastJSONRoute
from kvreuse.server.prompts import chat_prompt, check_model, completion_prompts, may_compile
from kvreuse.server.protocol import ChatCompletionRequest, CompletionRequest
from kvreuse.server.responses import respond
from kvreuse.server.state import StateDep

router = APIRouter(dependencies=[Depends(authenticate)], route_class=FastJSONRoute)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    reservation = reserve(state, tenant, request_sequences(len(body.prompts), body))
    try:
        prompts = await state.preparation.run(tenant, request, completion_prompts, state.engine.front_end, body,
                                              tenant, compiles=may_compile(body))
        return await respond(state, prompts, body, request, tenant, chat=False, reservation=reservation)
    finally:
        state.admissions.release(reservation)  # taken over by the admissions, or the request failed before


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    check_model(state.model_name, body.model)
    reservation = reserve(state, tenant, request_sequences(1, body))
    try:
        prompt, dropped = await state.preparation.run(tenant, request, chat_prompt, state.engine.front_end, body,
                                                      tenant, compiles=may_compile(body))
        return await respond(state, [prompt], body, request, tenant, chat=True, truncated_turns=dropped,
                             reservation=reservation)
    finally:
        state.admissions.release(reservation)
