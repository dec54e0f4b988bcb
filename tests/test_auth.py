"""API keys without a model: the key file format, Bearer parsing, and the 401 of the `authenticate` dependency."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvreuse.config import ConfigError
from kvreuse.server.auth import TenantDep, load_api_keys, tenant_for
from kvreuse.server.errors import add_error_handlers
from kvreuse.server.state import get_state

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
