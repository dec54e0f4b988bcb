"""Optional dependencies, imported where a feature that needs them starts, never by the plain server.

`pip install kvreuse` serves one model; each extra adds a feature (pyproject.toml's optional-dependencies):
`cluster` (Ray Serve, `cluster.replicas > 1`), `redis` (the Redis tier, `cache.redis.url`), `events` (ZeroMQ, KV
events at `events.endpoint`), `bench` (matplotlib, the benches' --out plots), `structured` (xgrammar: structured
output and tool grammars). xgrammar's metadata requires triton (1 GB, used only by its CUDA kernels), so `make run`
installs it without its dependencies instead, and the message names both commands.

A feature imports what it needs through `require`, which names the extra and its install command when it is missing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Extra:
    name: str                 # how a message names it
    install: str              # the command that installs it
    modules: tuple[str, ...]  # the top-level modules it provides
    used_for: str             # what needs it, for an import that failed outside `require`


EXTRAS = {
    "cluster": Extra("the cluster extra", "pip install 'kvreuse[cluster]'", ("ray",),
                     "replicas on Ray Serve (cluster.replicas > 1)"),
    "redis": Extra("the redis extra", "pip install 'kvreuse[redis]'", ("redis", "hiredis"),
                   "the Redis tier (cache.redis.url)"),
    "events": Extra("the events extra", "pip install 'kvreuse[events]'", ("zmq",), "KV events (events.endpoint)"),
    "bench": Extra("the bench extra", "pip install 'kvreuse[bench]'", ("matplotlib",), "the benches' plots"),
    "structured": Extra("the structured extra", "pip install 'kvreuse[structured]' (it brings triton, 1 GB, which "
                                                "xgrammar uses only on CUDA; without it: pip install --no-deps "
                                                "xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)",
                        ("xgrammar", "tvm_ffi"), "structured output"),
}

PLOTS = "writing --out's PNG plots"  # the feature of every bench plot (kvreuse/bench/plots.py)


class MissingExtraError(ModuleNotFoundError):
    """A feature was asked for whose optional dependency is not installed; the message names the feature, the
    extra and the command that installs it."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module` for `feature`, or raise MissingExtraError naming `extra` (a key of EXTRAS) and its install
    command. A module missing anywhere in the import (a dependency the extra brings, too) counts as the extra's."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingExtraError(message(extra, feature, exc.name or module), name=exc.name) from exc


def message(extra: str, feature: str, missing: str) -> str:
    """`feature` needs `extra`, which lacks the module `missing`: what to install."""
    what = EXTRAS[extra]
    return f"{feature} needs {what.name}, which is not installed (no module named {missing!r}): {what.install}"


def explain(exc: ModuleNotFoundError) -> str | None:
    """What to install for an import that failed outside `require`, if the missing module is an extra's."""
    top = (exc.name or "").split(".")[0]
    for key, extra in EXTRAS.items():
        if top in extra.modules:
            return message(key, extra.used_for, exc.name)
    return None
