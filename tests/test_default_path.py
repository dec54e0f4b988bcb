"""The commands as users run them: the documented `kvreuse generate` line, the documented Python `LLM` snippet and
`kvreuse serve` (what `make run` starts), each on the defaults in a subprocess, the decode step's compile included.

Each runs with no decode-step graphs built and an empty inductor cache, as on a fresh machine. The offline commands
then start no build (it would be cancelled at their exit); the server builds them in a process of its own, is still
building when it is stopped (the state that once aborted it with "terminate called without an active exception",
exit 134), and answers at eager speed or better meanwhile; a second start serves compiled from its first request.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from kvreuse.bench.first_run import fresh_cache, probes, served

from .helpers import doc_block
from .server_process import REPO_ROOT, http_client, start_server, stop

OFFLINE_DOC = REPO_ROOT / "docs" / "features" / "offline.md"
ABORTED = "terminate called"

pytestmark = pytest.mark.slow  # each loads the embedded model in its own process


def cold_inductor_env(tmp_path) -> dict[str, str]:
    """This environment with no decode-step graphs built and an empty inductor cache of the test's own (the rest of
    kvreuse's cache as `make install` left it): the decode step compiles from scratch."""
    return {**os.environ, "KVREUSE_CACHE_DIR": str(fresh_cache(tmp_path)),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}


def documented_command(containing: str) -> list[str]:
    """The documented `kvreuse generate` line that contains `containing`, as argv, its comment dropped."""
    block = doc_block(OFFLINE_DOC, "bash", containing)
    line = next(line for line in block.splitlines() if containing in line)
    argv = shlex.split(line, comments=True)
    assert argv[0] == ".venv/bin/kvreuse", line
    return [str(REPO_ROOT / argv[0]), *argv[1:]]


def test_kvreuse_generate_on_the_defaults_exits_0_with_its_answer_while_the_decode_step_compiles(tmp_path):
    argv = documented_command("--max-tokens 8 --json")
    done = subprocess.run(argv, cwd=REPO_ROOT, env=cold_inductor_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and ABORTED not in done.stderr, (done.returncode, done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["text"].strip() and out["completion_tokens"] == 8, out
    assert "[summary] requests=1" in done.stderr
    assert not (tmp_path / "kvreuse-cache" / "decode-graphs").exists()   # no build started, to be cancelled at exit


def test_the_documented_llm_script_on_the_defaults_exits_0_while_the_decode_step_compiles(tmp_path):
    code = doc_block(OFFLINE_DOC, "python", "llm = LLM()")   # as written, without `with` or close()
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cold_inductor_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and ABORTED not in done.stderr, (done.returncode, done.stderr[-3000:])
    answer, snapshot = done.stdout.strip().rsplit("\n", 1)   # `print(out.text, out.usage, out.ttft_s)`, the snapshot
    completion_tokens = int(re.search(r"completion_tokens=(\d+)", answer).group(1))
    assert 0 < completion_tokens <= 32 and "EngineSnapshot(" in snapshot
    assert "decode_graph=DecodeGraphStatus(state='eager'" in snapshot   # no build started, to be cancelled at exit
    assert not (tmp_path / "kvreuse-cache" / "decode-graphs").exists()


def test_kvreuse_serve_on_the_defaults_stops_on_sigterm_with_exit_0_while_the_decode_step_compiles(tmp_path):
    log = tmp_path / "serve.log"
    with start_server("--log-level", "info", log_path=log, compile_off=False, env=cold_inductor_env(tmp_path)) \
            as server, http_client() as client:
        response = client.post(f"{server.base_url}/chat/completions",
                               json={"model": server.model, "max_tokens": 8,
                                     "messages": [{"role": "user", "content": "Hi!"}]})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"].strip()
        returncode = stop(server.process)
    text = log.read_text(errors="replace")
    assert returncode == 0 and ABORTED not in text, (returncode, text[-3000:])
    assert "decode step compile cancelled" in text   # it was still compiling: the path that aborted


def test_a_fresh_server_answers_at_eager_speed_or_better_while_its_decode_step_is_built(tmp_path):
    """make run's command on a fresh machine: a 64-token request every 10 s from the ready line until the decode
    step's graphs are loaded, and one after. None may take 5x the fastest: eager decoding is ~1.4x the compiled
    step, and the compile in the serving process made them 10-50x slower (the benchmark: docs/bench/first-run/)."""
    env = cold_inductor_env(tmp_path)
    with served(env) as root:
        results = probes(root, "first", every_s=10.0, after=1, max_s=480.0)
    states = [p.compile for p in results]
    assert states[0] == "compiling" and states[-1] == "compiled", states
    fastest = min(p.seconds for p in results)
    assert max(p.seconds for p in results) < 5 * fastest, [(p.at_s, p.seconds, p.compile) for p in results]
    with served(env) as root:   # a second start loads what the first built before its ready line
        second = probes(root, "second", every_s=0.0, after=1, max_s=0.0)
    assert second[0].compile == "compiled", second
