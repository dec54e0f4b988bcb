"""OpenAI's model routes: `GET /v1/models` and `GET /v1/models/{model_id}` (API key required when configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from kvreuse.server.auth import authenticate
from kvreuse.server.prompts import check_model
from kvreuse.server.state import ServerState, StateDep

router = APIRouter(dependencies=[Depends(authenticate)])


def model_card(state: ServerState) -> dict:
    """The served model as OpenAI's model object, with vLLM's `max_model_len` beside."""
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvreuse",
            "max_model_len": state.engine.front_end.max_model_len}


@router.get("/v1/models")
async def list_models(state: StateDep):
    return {"object": "list", "data": [model_card(state)]}


# `:path`, since model ids such as "HuggingFaceTB/SmolLM2-135M-Instruct" hold slashes.
@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, state: StateDep):
    check_model(state.model_name, model_id)
    return model_card(state)
