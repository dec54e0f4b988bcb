"""Routes whose JSON body is parsed by pydantic-core (Rust) rather than the json module: a body is parsed on the
event loop, where every other request waits for it, and a prompt of 160K characters takes the json module ~15x
longer. Only what pydantic-core refuses (a lone surrogate escape, malformed JSON) goes to the json module, so
values and errors are the json module's."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute


class FastJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body)
            except ValueError:  # the json module decides: "\ud800" is a value, and its errors are FastAPI's 422
                self._json = json.loads(body)
        return self._json


class FastJSONRoute(APIRoute):
    """An APIRoute handing its endpoint a FastJSONRequest (FastAPI's documented custom-route hook)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return route
