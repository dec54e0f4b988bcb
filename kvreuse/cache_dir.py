"""Where kvreuse keeps what it derives once per machine (converted tokenizers, dtype probes, fingerprints, named
models assembled from their packages)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """`$KVREUSE_CACHE_DIR`, else ~/.cache/kvreuse."""
    return Path(os.environ.get("KVREUSE_CACHE_DIR", Path.home() / ".cache" / "kvreuse"))


def write_json_atomically(path: Path, value, what: str) -> bool:
    """Write `value` as JSON to `path` through a temporary file renamed into place, so a concurrent reader sees the
    old file or the new one, never half of one. False, logged as "could not `what` in PATH", where it cannot."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        logger.info("could not %s in %s: %s", what, path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


def keyed_path(kind: str, key: dict) -> Path:
    """Where the answer of a once-per-machine measurement of `kind` for `key` is kept: one file per key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_root() / kind / f"{digest[:16]}.json"


def read_keyed(path: Path, key: dict) -> dict | None:
    """The value stored at `path` (by `write_json_atomically`, as {"key": ..., "value": ...}) for `key`; None when
    absent, unreadable, corrupted or written for another key (logged: it is measured again)."""
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("value"), dict):
            return None
        return stored["value"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.info("ignoring %s (it is measured again): %s", path, exc)
        return None
