"""The tier secret: the key that signs every tier entry (entry.py), so that only processes holding it can write an
entry the others use. Write access to a tier without the key can then delete entries, never feed K/V.

It comes from `cache.tier_secret_file`; without one, from a key made on first use at `$KVREUSE_CACHE_DIR/tier.key`
(~/.cache/kvreuse), 0600: every server of this user on this machine shares it, and servers elsewhere that share a
Redis need the same file under `cache.tier_secret_file`. A key file others can write is refused (whoever can
change the key can sign entries); one they can read is used with a warning.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from kvreuse.cache_dir import cache_root
from kvreuse.config import ConfigError

logger = logging.getLogger(__name__)

MIN_BYTES = 32
DEFAULT_NAME = "tier.key"
KEY = "cache.tier_secret_file"


def load_tier_secret(path: str) -> bytes:
    """The key in the file `path` (`cache.tier_secret_file`, surrounding whitespace stripped), or for an empty
    `path` the default key, created if absent. ConfigError naming the key if the file cannot be read, holds fewer
    than MIN_BYTES bytes, or is writable by group or others."""
    if path:
        return _read(Path(path), f"{KEY} {path}")
    default = cache_root() / DEFAULT_NAME
    if not default.exists():
        try:
            _create(default)
        except OSError as exc:
            raise ConfigError(f"cannot create the default tier key {default} ({exc.strerror}); set {KEY} to a file "
                              f"holding at least {MIN_BYTES} bytes, or KVREUSE_CACHE_DIR to a writable directory") \
                from None
    return _read(default, f"the default tier key {default} (set {KEY} to use another)")


def _read(path: Path, what: str) -> bytes:
    try:
        mode = path.stat().st_mode
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it ({exc.strerror}); it must be a file holding at least {MIN_BYTES} "
                          f"bytes, e.g. made by `openssl rand -hex 32 > FILE; chmod 600 FILE`") from None
    if mode & 0o022:
        raise ConfigError(f"{what}: writable by group or others (mode {mode & 0o777:03o}); whoever can change the "
                          f"key can sign tier entries: `chmod 600` it")
    if len(key) < MIN_BYTES:
        raise ConfigError(f"{what}: holds {len(key)} bytes, a tier key needs at least {MIN_BYTES}, e.g. made by "
                          f"`openssl rand -hex 32 > FILE; chmod 600 FILE`")
    if mode & 0o044:
        logger.warning("%s is readable by group or others (mode %03o): they can sign tier entries", what, mode & 0o777)
    return key


def _create(path: Path) -> None:
    """A new random key at `path`, 0600 whatever the umask; written aside and linked into place, so a concurrent
    start never reads half a key (the first link wins, the other process reads that one)."""
    path.parent.mkdir(0o700, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with open(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(temp, path)
        logger.info("created the tier key %s: a server sharing these tiers from elsewhere needs the same key (%s)",
                    path, KEY)
    except FileExistsError:
        pass
    finally:
        temp.unlink(missing_ok=True)
