"""API keys without a model: the key file format, Bearer parsing, the 401 of the `authenticate` dependency, and the
admin keys (issue 26, finding 12): their file, and the 403 of `admin_only` for a tenant's key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from kvreuse.cli import build_config, build_parser
from kvreuse.config import ConfigError
from kvreuse.server.auth import TenantDep, admin_only, load_admin_keys, load_api_keys, tenant_for
from kvreuse.server.errors import add_error_handlers
from kvreuse.server.state import get_state

from .helpers import make_config

KEYS = {"key-alpha-123": "alpha", "key-beta-456": "beta"}


# --- tenant_for ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("header, tenant", [
    ("Bearer key-alpha-123", "alpha"),
    ("Bearer key-beta-456", "beta"),
    ("bearer key-alpha-123", "alpha"),      # the scheme is case-insensitive
    ("BEARER key-beta-456", "beta"),
    ("Bearer   key-alpha-123  ", "alpha"),  # surrounding blanks are not part of the key
])
def test_a_valid_bearer_key_gives_its_tenant(header, tenant):
    assert tenant_for(KEYS, header) == tenant


@pytest.mark.parametrize("header", [
    None,                          # no Authorization header
    "",
    "Bearer",                      # no key
    "Bearer ",
    "Bearer wrong-key",
    "Bearer key-alpha-12",         # a prefix of a key
    "Bearer key-alpha-123x",       # a key plus more
    "Bearer KEY-ALPHA-123",        # keys are case-sensitive
    "key-alpha-123",               # no scheme
    "Basic key-alpha-123",         # another scheme
    "Bearerkey-alpha-123",
])
def test_anything_else_gives_no_tenant(header):
    assert tenant_for(KEYS, header) is None


# --- load_api_keys ---------------------------------------------------------------------------------------
def write(tmp_path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_text_file_with_comments_and_blank_lines(tmp_path):
    path = write(tmp_path, "# key tenant\n\nkey-alpha-123 alpha   # the first team\n  key-beta-456\tbeta\n#\n")
    assert load_api_keys(path) == KEYS


def test_json_file(tmp_path):
    assert load_api_keys(write(tmp_path, '  {"key-alpha-123": "alpha", "key-beta-456": "beta"}\n')) == KEYS


@pytest.mark.parametrize("text, line", [
    ("key-alpha-123 alpha\nkey-beta-456\n", 2),               # no tenant
    ("# keys\n\nkey-alpha-123 alpha extra\n", 3),             # one word too many; comments count as lines
])
def test_a_bad_text_line_is_named_by_its_number(tmp_path, text, line):
    with pytest.raises(ConfigError, match=rf", line {line}: expected `KEY TENANT`"):
        load_api_keys(write(tmp_path, text))


@pytest.mark.parametrize("text, message", [
    ("", "no keys"),
    ("# only a comment\n\n", "no keys"),
    ("{}", "no keys"),
    ('{"key-alpha-123": "alpha",}', r"invalid JSON \(.*, line 1\)"),
    ('{"key-alpha-123": ""}', "non-empty strings"),
    ('{"": "alpha"}', "non-empty strings"),
    ('{"key-alpha-123": 7}', "non-empty strings"),
])
def test_empty_or_invalid_files_are_config_errors(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_api_keys(write(tmp_path, text))


def test_an_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"))


# --- the authenticate dependency -------------------------------------------------------------------------
def client_with_keys(api_keys: dict[str, str] | None) -> TestClient:
    app = FastAPI()
    add_error_handlers(app)
    app.dependency_overrides[get_state] = lambda: SimpleNamespace(api_keys=api_keys)

    @app.get("/whoami")
    async def whoami(tenant: TenantDep):
        return {"tenant": tenant}

    return TestClient(app)


def test_the_dependency_maps_the_key_to_its_tenant():
    client = client_with_keys(KEYS)
    r = client.get("/whoami", headers={"Authorization": "Bearer key-beta-456"})
    assert r.status_code == 200 and r.json() == {"tenant": "beta"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}])
def test_the_dependency_answers_401_in_openai_error_format(headers):
    r = client_with_keys(KEYS).get("/whoami", headers=headers)
    assert r.status_code == 401
    assert r.json() == {"error": {"message": "invalid or missing API key (Authorization: Bearer KEY)",
                                  "type": "authentication_error", "param": None, "code": "invalid_api_key"}}


def test_without_keys_every_request_passes_with_no_tenant():
    r = client_with_keys(None).get("/whoami", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 200 and r.json() == {"tenant": None}


# --- admin keys (issue 26, finding 12) -------------------------------------------------------------------
ADMIN = {"key-ops-789": "ops"}


def admin_client(api_keys: dict[str, str] | None, admin_keys: dict[str, str] | None) -> TestClient:
    app = FastAPI()
    add_error_handlers(app)
    keys = None if api_keys is None else {**api_keys, **(admin_keys or {})}
    app.dependency_overrides[get_state] = lambda: SimpleNamespace(api_keys=keys, admin_keys=admin_keys)

    @app.post("/reset_prefix_cache", dependencies=[Depends(admin_only("drops every tenant's cached KV"))])
    async def reset():
        return {"status": "ok"}

    return TestClient(app)


def test_a_tenant_key_gets_403_naming_the_route_and_the_admin_key_it_needs():
    r = admin_client(KEYS, ADMIN).post("/reset_prefix_cache", headers={"Authorization": "Bearer key-alpha-123"})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "admin_key_required"
    for needle in ("POST /reset_prefix_cache", "drops every tenant's cached KV", "admin API key", "--admin-api-keys",
                   "server.admin_api_keys_file"):
        assert needle in error["message"], error["message"]


def test_an_admin_key_passes_and_no_key_gets_401():
    client = admin_client(KEYS, ADMIN)
    assert client.post("/reset_prefix_cache", headers={"Authorization": "Bearer key-ops-789"}).status_code == 200
    for headers in ({}, {"Authorization": "Bearer key-ops-78"}):
        r = client.post("/reset_prefix_cache", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_with_keys_but_no_admin_keys_the_admin_routes_are_closed_saying_so():
    r = admin_client(KEYS, None).post("/reset_prefix_cache", headers={"Authorization": "Bearer key-beta-456"})
    assert r.status_code == 403 and "this server has none" in r.json()["error"]["message"]


def test_without_any_keys_the_admin_routes_stay_open():
    assert admin_client(None, None).post("/reset_prefix_cache").status_code == 200


def test_the_admin_key_file_has_the_api_key_format_and_needs_api_keys(tmp_path):
    path = tmp_path / "admin.txt"
    path.write_text("# operators\nkey-ops-789 ops\n")
    server = make_config(server__admin_api_keys_file=str(path)).server
    assert load_admin_keys(server, KEYS) == ADMIN
    assert load_admin_keys(make_config().server, KEYS) is None
    with pytest.raises(ConfigError, match=r"server.admin_api_keys_file \(--admin-api-keys\) needs "
                                          r"server.api_keys_file"):
        load_admin_keys(server, None)
    path.write_text("key-ops-789\n")
    with pytest.raises(ConfigError, match=r"server.admin_api_keys_file .*, line 1: expected `KEY TENANT`"):
        load_admin_keys(server, KEYS)


def test_an_admin_key_that_is_also_another_tenants_key_is_a_config_error(tmp_path):
    path = tmp_path / "admin.json"
    path.write_text('{"key-alpha-123": "ops"}')
    server = make_config(server__admin_api_keys_file=str(path)).server
    with pytest.raises(ConfigError, match="admin 'ops' has a key that server.api_keys_file gives to tenant 'alpha'"):
        load_admin_keys(server, KEYS)
    path.write_text('{"key-alpha-123": "alpha"}')  # the same key and tenant in both: one tenant, also admin
    assert load_admin_keys(server, KEYS) == {"key-alpha-123": "alpha"}


def test_the_serve_flag_sets_the_admin_keys_file(tmp_path):
    args = build_parser().parse_args(["serve", "--api-keys", "k.txt", "--admin-api-keys", str(tmp_path / "a.txt")])
    assert build_config(args).server.admin_api_keys_file == str(tmp_path / "a.txt")
