"""The gates every HTTP request passes before FastAPI reads its body or routes it, outermost first:

1. `DrainingGate`: 503 once SIGTERM arrived (but /metrics, which Prometheus keeps scraping);
2. `AuthGate`: with API keys, 401 without a valid `Authorization: Bearer KEY` (a tenant's or an admin's) on every
   route but /health: a header check, so a caller without a key never gets its body read (nor parsed, nor answered
   with a 400); which key may call the admin routes is the routes' own check (`auth.admin_only`, 403);
3. `BodyLimitGate`: 413 for a body over `server.max_body_mb`, refused by its Content-Length before a byte of
   it is read, or, sent chunked, counted as it streams in and stopped at the limit.

Plain ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides client disconnects from
the endpoint, and a disconnected client must abort its request. A refusal closes the connection, so that the
rest of a refused body is never read, not even to be thrown away.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvreuse.server.auth import tenant_for, unauthorized_body
from kvreuse.server.protocol import error_body

MB = 1024 * 1024
OPEN_WITH_KEYS = frozenset({"/health"})  # load balancers probe it without a key


async def refuse(scope, receive, send, status: int, body: dict) -> None:
    """Answer with an OpenAI error and close the connection."""
    await JSONResponse(body, status, headers={"Connection": "close"})(scope, receive, send)


def header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:  # ASGI servers give header names lower-cased
            return value.decode("latin-1")
    return None


class DrainingGate:
    """503 for every request but /metrics while the server drains."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/metrics" and scope["app"].state.kvreuse.draining:
            body = error_body("the server is shutting down", "service_unavailable")
            return await refuse(scope, receive, send, 503, body)
        return await self.app(scope, receive, send)


class AuthGate:
    """With `api_keys` (key -> tenant), 401 for a request without a valid key to anything but /health:
    /metrics, /docs, /redoc and /openapi.json included. Without keys, a pass-through."""

    def __init__(self, app, api_keys: dict[str, str] | None):
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and self.api_keys is not None and scope["path"] not in OPEN_WITH_KEYS
                and tenant_for(self.api_keys, header(scope, b"authorization")) is None):
            return await refuse(scope, receive, send, 401, unauthorized_body())
        return await self.app(scope, receive, send)


class BodyLimitGate:
    """413 for a request body over `max_body_mb` (`server.max_body_mb`), before it is read whole."""

    def __init__(self, app, max_body_mb: int):
        self.app, self.max_body_mb = app, max_body_mb

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_mb * MB:
            return await refuse(scope, receive, send, 413, self.too_large(f"request body of {declared} bytes"))
        meter = BodyMeter(self, scope, receive, send)
        await self.app(scope, meter.receive, meter.send)

    def too_large(self, what: str) -> dict:
        return error_body(f"{what} exceeds the limit of {self.max_body_mb} MB ({self.max_body_mb * MB} bytes, "
                          f"server.max_body_mb = {self.max_body_mb})", code="request_too_large")


class BodyMeter:
    """One request's `receive` and `send`, counting the body as the app reads it. Past the limit the gate
    answers 413 itself (unless the app already answered) and the app is told that the client is gone, so it
    reads no further and its own answer is dropped."""

    def __init__(self, gate: BodyLimitGate, scope, receive, send):
        self.gate, self.scope, self._receive, self._send = gate, scope, receive, send
        self.received = 0
        self.over = False            # the body went past the limit
        self.refused = False         # and the 413 went out
        self.app_answering = False   # the app's response started before that

    async def receive(self):
        if self.over:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.gate.max_body_mb * MB:
                self.over = True
                if not self.app_answering:
                    self.refused = True
                    await refuse(self.scope, self._receive, self._send, 413,
                                 self.gate.too_large("chunked request body"))
                return {"type": "http.disconnect"}
        return message

    async def send(self, message):
        if self.refused:
            return  # the 413 is the answer
        if message["type"] == "http.response.start":
            self.app_answering = True
        await self._send(message)
