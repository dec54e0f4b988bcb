"""The commands as users run them: the documented `kvreuse generate` line, the documented Python `LLM` snippet and
`kvreuse serve` (what `make run` starts), each on the defaults in a subprocess, the decode step's compile included.

Each runs with an empty inductor cache, so the compile is still running when the process ends (it takes ~25-60 s;
the commands are done in seconds): exactly the state that aborted them with "terminate called without an active
exception" (exit 134), since a daemon thread left inside torch at interpreter exit is killed in a C++ frame.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from .helpers import doc_block
from .server_process import REPO_ROOT, http_client, start_server, stop

OFFLINE_DOC = REPO_ROOT / "docs" / "features" / "offline.md"
ABORTED = "terminate called"

pytestmark = pytest.mark.slow  # each loads the embedded model in its own process


def cold_inductor_env(tmp_path) -> dict[str, str]:
    """This environment with an empty inductor cache of the test's own: the decode step compiles from scratch."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}


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


def test_the_documented_llm_script_on_the_defaults_exits_0_while_the_decode_step_compiles(tmp_path):
    code = doc_block(OFFLINE_DOC, "python", "LLM(load_config(")
    (tmp_path / "kvreuse.ini").write_text("[cache]\nblock_size = 16\n")   # the file the snippet loads
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cold_inductor_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and ABORTED not in done.stderr, (done.returncode, done.stderr[-3000:])
    answer, snapshot = done.stdout.strip().rsplit("\n", 1)   # `print(out.text, out.usage, out.ttft_s)`, the snapshot
    completion_tokens = int(re.search(r"completion_tokens=(\d+)", answer).group(1))
    assert 0 < completion_tokens <= 32 and "EngineSnapshot(" in snapshot
    assert "decode_graph=DecodeGraphStatus(state='compiling'" in snapshot   # the state it exits in


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
