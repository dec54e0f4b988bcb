"""`server.api_keys_file`: API key -> tenant. The tenant becomes the cache salt of its requests."""

from __future__ import annotations

import json
from pathlib import Path

from kvreuse.config import ConfigError


def load_api_keys(path: str) -> dict[str, str]:
    """JSON ({"KEY": "tenant", ...}) or text, one `KEY TENANT` per line (# starts a comment)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"server.api_keys_file: cannot read {path}: {exc.strerror}") from exc
    if text.lstrip().startswith("{"):
        try:
            keys = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"server.api_keys_file {path}: invalid JSON ({exc.msg}, line {exc.lineno})") from exc
        if not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in keys.items()):
            raise ConfigError(f"server.api_keys_file {path}: expected an object of non-empty strings KEY -> tenant")
    else:
        keys = {}
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"server.api_keys_file {path}, line {number}: expected `KEY TENANT`")
            keys[parts[0]] = parts[1]
    if not keys:
        raise ConfigError(f"server.api_keys_file {path}: no keys")
    return keys
