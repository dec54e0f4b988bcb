"""Every error the server answers is OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`.

Routes raise `APIError`; request validation, unknown routes and wrong methods are rendered in the same shape.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreuse.server.protocol import error_body


class APIError(Exception):
    """An error response: HTTP `status`, OpenAI's `type`, the request field it is about (`param`), an
    optional machine-readable `code` and extra response `headers` (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers


def add_error_handlers(app: FastAPI) -> None:
    """Render APIError, validation errors and the router's own 404/405 as OpenAI errors."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


def validation_message(first: dict) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's validation errors of a request."""
    if first.get("type") == "json_invalid":
        message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    else:
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{param}: {first['msg']}" if param else first["msg"].removeprefix("Value error, ")
    # Our own model validators raise ValueError, which pydantic prefixes; clients need not see that.
    return message.replace("Value error, ", ""), param


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), exc.type, exc.param, exc.code), exc.status, headers=exc.headers)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc.errors()[0])
    return JSONResponse(error_body(message, param=param), 400)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), type_), exc.status_code, headers=exc.headers)
