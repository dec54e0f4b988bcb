"""Comparing token (or character) sequences: shared by the cache, its simulator and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
