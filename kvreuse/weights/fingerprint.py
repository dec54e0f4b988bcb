"""The weights' fingerprint (sha256 of their files' bytes), remembered on disk per file version, so that a start does
not hash hundreds of MB again to learn what it learned last time."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from kvreuse.cache_dir import cache_root, write_json_atomically

logger = logging.getLogger(__name__)


def sha256_of_files(paths: list[Path]) -> str:
    """sha256 over the files' bytes, concatenated in sorted path order."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def cached_sha256(paths: list[Path]) -> str:
    """`sha256_of_files(paths)`, remembered under `cache_root() / "fingerprints"` by each file's resolved path, size
    and mtime: a file changed since is hashed again. A missing, stale or unreadable memo is recomputed, never an
    error; OSError only where the files themselves cannot be read."""
    files = sorted(paths)
    versions = _versions(files)
    memo = _memo_path(versions)
    known = _read_memo(memo, versions)
    if known is not None:
        return known
    digest = sha256_of_files(files)
    if _versions(files) == versions:  # not rewritten while it was hashed
        _write_memo(memo, versions, digest)
    return digest


def _versions(files: list[Path]) -> list[list]:
    versions = []
    for path in files:
        stat = path.stat()
        versions.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return versions


def _memo_path(versions: list[list]) -> Path:
    key = hashlib.sha256(json.dumps(versions).encode()).hexdigest()
    return cache_root() / "fingerprints" / f"{key[:32]}.json"


def _read_memo(memo: Path, versions: list[list]) -> str | None:
    try:
        record = json.loads(memo.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.info("ignoring fingerprint memo %s: %s", memo, exc)
        return None
    if not isinstance(record, dict):
        record = {}
    digest = record.get("sha256")
    if record.get("files") != versions or not isinstance(digest, str) or len(digest) != 64 \
            or any(c not in "0123456789abcdef" for c in digest):
        logger.info("ignoring fingerprint memo %s: it is not for these files", memo)
        return None
    return digest


def _write_memo(memo: Path, versions: list[list], digest: str) -> None:
    write_json_atomically(memo, {"files": versions, "sha256": digest}, "remember the fingerprint")
