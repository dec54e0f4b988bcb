"""API keys: the `server.api_keys_file` format and the dependency that maps a request's key to its tenant.

The tenant becomes the cache salt of the tenant's requests, so tenants never share KV, and it owns a share of
the queue (`server.max_queue_per_tenant`). `gates.AuthGate` checks the key before a body is read; the
dependency checks it again for the routes and hands them the tenant.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from kvreuse.config import ConfigError
from kvreuse.server.errors import APIError
from kvreuse.server.protocol import error_body
from kvreuse.server.state import StateDep

UNAUTHORIZED = "invalid or missing API key (Authorization: Bearer KEY)"


async def authenticate(request: Request, state: StateDep) -> str | None:
    """Dependency: the caller's tenant, or None when the server runs without API keys. Raises 401 when
    keys are configured and the request has no valid `Authorization: Bearer KEY`."""
    if state.api_keys is None:
        return None
    tenant = tenant_for(state.api_keys, request.headers.get("authorization"))
    if tenant is None:
        raise APIError(401, UNAUTHORIZED, "authentication_error", code="invalid_api_key")
    return tenant


def unauthorized_body() -> dict:
    """The 401's OpenAI error body, the same from the gate (before the body is read) and the dependency."""
    return error_body(UNAUTHORIZED, "authentication_error", code="invalid_api_key")


# A route parameter of this type receives the tenant; FastAPI calls `authenticate` once per request however
# often it is declared (router and route).
TenantDep = Annotated[str | None, Depends(authenticate)]


def tenant_for(api_keys: dict[str, str], header: str | None) -> str | None:
    """The tenant of a `Bearer KEY` header, compared in constant time against every key."""
    token = header[7:].strip() if header and header.lower().startswith("bearer ") else ""
    found = None
    # No early exit: the time taken must not tell how many keys there are or which one matched.
    for key, tenant in api_keys.items():
        if hmac.compare_digest(token.encode(), key.encode()):
            found = tenant
    return found


def load_api_keys(path: str) -> dict[str, str]:
    """KEY -> tenant from JSON (`{"KEY": "tenant", ...}`) or text (one `KEY TENANT` per line, `#` starts a
    comment). Raises ConfigError naming the file (and the line) for anything else, or for no keys at all."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"server.api_keys_file: cannot read {path}: {exc.strerror}") from exc
    keys = _parse_json_keys(path, text) if text.lstrip().startswith("{") else _parse_text_keys(path, text)
    if not keys:
        raise ConfigError(f"server.api_keys_file {path}: no keys")
    return keys


def _parse_json_keys(path: str, text: str) -> dict[str, str]:
    try:
        keys = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"server.api_keys_file {path}: invalid JSON ({exc.msg}, line {exc.lineno})") from exc
    if not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in keys.items()):
        raise ConfigError(f"server.api_keys_file {path}: expected an object of non-empty strings KEY -> tenant")
    return keys


def _parse_text_keys(path: str, text: str) -> dict[str, str]:
    keys = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"server.api_keys_file {path}, line {number}: expected `KEY TENANT`")
        keys[parts[0]] = parts[1]
    return keys
