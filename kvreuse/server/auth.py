"""API keys: the `server.api_keys_file` format, the dependency that maps a request's key to its tenant, and the one
that keeps the admin and observability routes to admin keys.

The tenant becomes the cache salt of the tenant's requests, so tenants never share KV, and it owns a share of
the queue (`server.max_queue_per_tenant`) and of the preparation threads. `gates.AuthGate` checks the key before a
body is read; the dependency checks it again for the routes and hands them the tenant.

Admin keys (`server.admin_api_keys_file`, the same format: `KEY NAME`) are keys of their own tenant, NAME, that may
also call what acts on or shows every tenant's state: `/reset_prefix_cache`, `/cache/stats`, `/metrics`. With API
keys those need one (403 for a tenant's key); without API keys (a local server) every route stays open.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from kvreuse.config import ConfigError, ServerConfig
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


def admin_only(what: str):
    """A dependency for a route that `what` (acts on or shows every tenant's state): with API keys, 401 without a
    valid key and 403 (naming the route and the admin key it needs) for a key that is not an admin key."""

    async def require_admin(request: Request, state: StateDep) -> None:
        if state.api_keys is None:
            return  # a server without keys: every route is open
        header = request.headers.get("authorization")
        if tenant_for(state.api_keys, header) is None:
            raise APIError(401, UNAUTHORIZED, "authentication_error", code="invalid_api_key")
        if tenant_for(state.admin_keys or {}, header) is None:
            none = "" if state.admin_keys else " (this server has none)"
            raise APIError(403, f"{request.method} {request.url.path} {what}: it needs an admin API key{none} "
                                f"(--admin-api-keys, server.admin_api_keys_file), not a tenant's key",
                           "permission_error", code="admin_key_required")

    return require_admin


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


def load_api_keys(path: str, setting: str = "server.api_keys_file") -> dict[str, str]:
    """KEY -> tenant from JSON (`{"KEY": "tenant", ...}`) or text (one `KEY TENANT` per line, `#` starts a
    comment). Raises ConfigError naming the `setting`, the file (and the line) for anything else, or for no keys."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from exc
    where = f"{setting} {path}"
    keys = _parse_json_keys(where, text) if text.lstrip().startswith("{") else _parse_text_keys(where, text)
    if not keys:
        raise ConfigError(f"{where}: no keys")
    return keys


def load_admin_keys(server: ServerConfig, api_keys: dict[str, str] | None) -> dict[str, str] | None:
    """KEY -> name of `server.admin_api_keys_file`, or None when it is not set. ConfigError if it is set without
    API keys (there would be no tenant keys to tell them from) or gives a tenant's key another name."""
    if not server.admin_api_keys_file:
        return None
    if api_keys is None:
        raise ConfigError("server.admin_api_keys_file (--admin-api-keys) needs server.api_keys_file (--api-keys): "
                          "without API keys every route is open, the admin routes included")
    admin_keys = load_api_keys(server.admin_api_keys_file, "server.admin_api_keys_file")
    for key, name in admin_keys.items():
        if api_keys.get(key, name) != name:
            raise ConfigError(f"server.admin_api_keys_file: admin {name!r} has a key that server.api_keys_file gives "
                              f"to tenant {api_keys[key]!r}; a key has one tenant")
    return admin_keys


def _parse_json_keys(where: str, text: str) -> dict[str, str]:
    try:
        keys = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON ({exc.msg}, line {exc.lineno})") from exc
    if not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in keys.items()):
        raise ConfigError(f"{where}: expected an object of non-empty strings KEY -> tenant")
    return keys


def _parse_text_keys(where: str, text: str) -> dict[str, str]:
    keys = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{where}, line {number}: expected `KEY TENANT`")
        keys[parts[0]] = parts[1]
    return keys
