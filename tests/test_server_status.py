"""What the server says about itself in the first minutes (issue 47): the decode step's compile state in /health and
/metrics (the real app in-process, on a real engine whose graph is put in each state the compile thread sets), the
settings line after the ready line, and the model id a named model is served as.

`kvreuse serve` subprocesses (the ready and settings lines, `/v1/models`, `--served-model-name`) are in
test_server.py; this file holds what needs the engine in this process, or no server at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.engine.stats import COMPILE_STATES, compile_summary
from kvreuse.server.lifecycle import served_model_name, settings_line

from .helpers import app_server, make_config, tiny_engine
from .server_process import Metrics, http_client


@pytest.fixture(scope="module")
def compiling_engine_server(tiny_model_dir):
    """The app serving a tiny engine with `engine.compile = decode` (its compile not started: conftest)."""
    engine = tiny_engine(tiny_model_dir, engine__compile="decode")
    with app_server(engine) as (_, root), http_client(30.0) as http:
        yield engine, root, http
        engine.runner.decode_graph.state = "eager"  # "compiled" without loaded graphs must not outlive the test


@pytest.mark.parametrize("state", COMPILE_STATES)
def test_health_and_metrics_show_the_decode_steps_compile_state(compiling_engine_server, state):
    engine, root, http = compiling_engine_server
    engine.runner.decode_graph.state = state  # what the compile thread sets (no request runs a step meanwhile)
    health = http.get(f"{root}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "compile": state}
    scrape = Metrics.parse(http.get(f"{root}/metrics").text)
    assert {s: scrape.get("kvreuse:decode_compile_state", model_name="tiny", state=s) for s in COMPILE_STATES} \
        == {s: float(s == state) for s in COMPILE_STATES}


def test_compile_off_is_eager(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, engine__compile="off")
    with app_server(engine) as (_, root), http_client(30.0) as http:
        assert http.get(f"{root}/health").json() == {"status": "ok", "compile": "eager"}
        scrape = Metrics.parse(http.get(f"{root}/metrics").text)
        assert scrape.get("kvreuse:decode_compile_state", state="eager") == 1
        assert scrape.get("kvreuse:decode_compile_state") == 1  # one engine, in one state


def test_replicas_in_different_states_are_summarised():
    assert compile_summary(["compiled", "compiling", "compiled"]) == "mixed: 1 compiling, 2 compiled"
    assert compile_summary(["compiled", "compiled"]) == "compiled"
    assert compile_summary([]) == "unknown"  # a cluster whose replicas have served nothing yet


def test_a_named_model_is_served_as_the_name_given():
    """`--model gemma3-270m` is served as gemma3-270m, not as its file's name (gemma-3-270m-q4_k_m)."""
    weights = Path("/models/gemma-3-270m-q4_k_m.gguf")
    assert served_model_name(make_config(model__path="gemma3-270m"), weights) == "gemma3-270m"
    assert served_model_name(make_config(model__path=str(weights)), weights) == "gemma-3-270m-q4_k_m"
    assert served_model_name(make_config(), Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    renamed = make_config(model__path="gemma3-270m", model__served_name="acme/gemma")
    assert served_model_name(renamed, weights) == "acme/gemma"


@pytest.mark.parametrize(("sets", "named"), [
    ({"cache__preset": "rag"}, ["preset rag (cache.preset)", "segment reuse, approximate: blend recomputing 30%",
                                "eviction learned (cache.policy)"]),
    ({"model__quantization": "int8"}, ["weights quantized to int8, approximate (model.quantization)"]),
    ({"cache__suffix__enabled": "true", "cache__suffix__mode": "shift"}, ["shift, unrepaired"]),
    ({"cache__redis__url": "redis://user:secret@host:6379/0"}, ["Redis tier (cache.redis.url)"]),
    ({"cache__session_retention_s": 60}, ["session retention 60 s, up to 100% of the pool"]),
    ({"cache__enabled": "false"}, ["no KV reuse (cache.enabled)"]),
    ({"cache__normalize_input": "true"}, ["input normalized"]),
])
def test_the_settings_line_names_each_non_default_behaviour(sets, named):
    line = settings_line(make_config(**sets), "compiled")
    assert all(part in line for part in named), line
    assert "defaults" not in line and "secret" not in line
    assert line.endswith("; decode step compiled")
