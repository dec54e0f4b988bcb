"""Where kvreuse keeps what it derives once per machine (converted tokenizers, dtype probes, fingerprints, named
models assembled from their packages)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$KVREUSE_CACHE_DIR`, else ~/.cache/kvreuse."""
    return Path(os.environ.get("KVREUSE_CACHE_DIR", Path.home() / ".cache" / "kvreuse"))
