"""Every error the server answers is OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`.

Routes raise `APIError`; request validation, unknown routes and wrong methods are rendered in the same shape, and
so is any exception nothing else handled (500, `server_error`, logged): no request ever gets a bare 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreuse.server.protocol import FieldError, error_body

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error response: HTTP `status`, OpenAI's `type`, the request field it is about (`param`), an
    optional machine-readable `code` and extra response `headers` (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers


def add_error_handlers(app: FastAPI) -> None:
    """Render APIError, validation errors, the router's own 404/405 and any unexpected exception as OpenAI errors."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


def validation_message(first: dict) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's validation errors of a request."""
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    error = first.get("ctx", {}).get("error")
    if isinstance(error, FieldError):  # a check of the whole body, about one field
        return str(error), error.param
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    # Our own validators raise ValueError, which pydantic prefixes; clients need not see that.
    message = first["msg"].removeprefix("Value error, ")
    if param and not message.startswith((f"{param} ", f"{param}:")):
        message = f"{param}: {message}"
    return message, param


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), exc.type, exc.param, exc.code), exc.status, headers=exc.headers)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc.errors()[0])
    return JSONResponse(error_body(message, param=param), 400)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), type_), exc.status_code, headers=exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette sends this response, then re-raises, so the server's log gets the traceback as well.
    logger.error("unexpected %s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
    return JSONResponse(error_body(f"internal server error ({type(exc).__name__}); the server logged it and keeps "
                                   f"serving", "server_error"), 500)
