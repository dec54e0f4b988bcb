"""A plain install (no extra) serves: the server, the engine and the CLI import none of the extras' modules, and a
feature whose extra is missing fails at its start with a message naming the extra and its install command.

Each check runs in a fresh interpreter whose imports of the extras' modules fail (as they would where the extras are
not installed), since this test environment has them all."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvreuse.extras import EXTRAS

EXTRA_MODULES = ("ray", "redis", "hiredis", "zmq", "matplotlib")
GRAMMAR_MODULES = ("xgrammar", "tvm_ffi")

BLOCKER = """
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
"""


def run_without(blocked: tuple[str, ...], code: str) -> dict:
    """Run `code` where `blocked` cannot be imported; the JSON it prints last."""
    script = f"BLOCKED = {set(blocked)!r}\n{BLOCKER}\n{textwrap.dedent(code)}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_server_the_engine_and_the_cli_import_no_extra():
    loaded = run_without(EXTRA_MODULES + GRAMMAR_MODULES, """
        import json, sys
        import kvreuse.cli, kvreuse.engine.engine, kvreuse.llm, kvreuse.server.app, kvreuse.server.lifecycle
        import kvreuse.cluster.launch, kvreuse.kvcache.tiers.store
        kvreuse.cli.build_parser().parse_args(["serve"])
        kvreuse.cli.build_parser().parse_args(["generate", "hi"])
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)))
    """)
    assert loaded == []


def test_a_missing_extra_is_named_with_its_install_command():
    errors = run_without(EXTRA_MODULES + GRAMMAR_MODULES, """
        import json
        from kvreuse.extras import MissingExtraError, require
        errors = {}
        for module, extra, feature in [("redis", "redis", "cache.redis.url"), ("ray.serve", "cluster", "replicas"),
                                       ("zmq", "events", "events.endpoint"), ("matplotlib", "bench", "plots"),
                                       ("xgrammar", "structured", "structured output")]:
            try:
                require(module, extra, feature)
            except MissingExtraError as exc:
                assert isinstance(exc, ModuleNotFoundError)
                errors[extra] = str(exc)
        print(json.dumps(errors))
    """)
    assert set(errors) == set(EXTRAS)
    assert errors["redis"] == ("cache.redis.url needs the redis extra, which is not installed (no module named "
                               "'redis'): pip install 'kvreuse[redis]'")
    assert errors["cluster"].startswith("replicas needs the cluster extra")
    assert "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2" in errors["structured"]


def test_each_feature_fails_at_its_start_naming_its_extra():
    errors = run_without(EXTRA_MODULES, """
        import json
        from kvreuse.config import CacheConfig, EventsConfig
        from kvreuse.extras import MissingExtraError
        from kvreuse.kvcache.events import KVEventPublisher
        from kvreuse.kvcache.tiers.redis_tier import RedisTier
        from kvreuse.kvcache.tiers.store import build_tiers
        errors = {"no tier": len(build_tiers(CacheConfig()))}
        for name, start in [("events", lambda: KVEventPublisher(EventsConfig(endpoint="inproc://x"), 16, "CPU")),
                            ("redis", lambda: RedisTier("redis://127.0.0.1:1/0"))]:
            try:
                start()
            except MissingExtraError as exc:
                errors[name] = str(exc)
        print(json.dumps(errors))
    """)
    assert errors["no tier"] == 0
    assert errors["events"].startswith("events.endpoint needs the events extra")
    assert errors["redis"].startswith("cache.redis.url needs the redis extra")


@pytest.mark.parametrize("args, message", [
    (["serve", "--replicas", "2"], "cluster.replicas > 1 needs the cluster extra"),
    (["serve", "--set", "cache.redis.url=redis://127.0.0.1:1/0"], "cache.redis.url needs the redis extra"),
    (["bench", "trace", "no-such-trace.csv", "--out", "out"], "writing --out's PNG plots needs the bench extra"),
])
def test_the_cli_exits_naming_the_missing_extra(args, message):
    result = run_without(EXTRA_MODULES, f"""
        import contextlib, io, json
        from kvreuse.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main({args!r})
        print(json.dumps([code, err.getvalue()]))
    """)
    code, stderr = result
    assert code == 1
    assert message in stderr and "pip install 'kvreuse[" in stderr


def test_without_xgrammar_formats_are_refused_naming_the_fix():
    errors = run_without(GRAMMAR_MODULES, """
        import json
        from kvreuse.structured import parse_format
        from kvreuse.structured.errors import UnsupportedFormat
        from kvreuse.structured.unavailable import NoGrammarEngine
        from kvreuse.structured.errors import engine_missing
        errors = {}
        try:
            parse_format(None, guided_regex="[a-z]+")
        except UnsupportedFormat as exc:
            errors["guided_regex"] = [exc.field, str(exc)]
        spec = parse_format({"type": "json_object"})
        try:
            NoGrammarEngine(engine_missing()).compile(spec)
        except UnsupportedFormat as exc:
            errors["response_format"] = [exc.field, str(exc)]
        print(json.dumps(errors))
    """)
    for field in ("guided_regex", "response_format"):
        assert errors[field][0] == field
        assert errors[field][1].startswith(f"{field}: structured output")
        assert "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2" in errors[field][1]
