"""Hostile model files (issue 49): each bad value of a GGUF's metadata or an HF directory's config.json, a missing or
misshapen tensor, a broken config.json and a truncated safetensors file is one ModelLoadError naming the file and the
key, before anything is sized by it; `kvreuse generate` and `kvreuse serve` print that one line and exit 1, and the
huge sizes (a context of 10^9, 10^6 layers) are refused fast and within a small memory limit: each command's wall
time and peak RSS are measured (its own, from wait4) and bounded (the figures: docs/server.md, Security)."""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.loader import load_model_info, load_weights

from .test_gguf_architectures import write_gguf

MEMORY_LIMIT = 4 * 2**30  # the commands' address space (RLIMIT_AS), as under `prlimit --as`
TIMEOUT_S = 60
# What a refusal may take: importing torch and reading the metadata (measured: docs/server.md, Security). Before issue
# 49 an integer context of 10^9 made RoPE tables of 8 GB (under the 4 GB limit: a traceback instead), and 10^6 layers
# ran for more than 120 s.
MAX_PEAK_RSS = 2**30
MAX_WALL_S = 40.0
# The same refusal in a process that has torch loaded already: what reading the metadata adds.
MAX_IN_PROCESS_GROWTH = 256 * 2**20
MAX_IN_PROCESS_WALL_S = 10.0


@pytest.fixture
def hf_dir(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny Llama's directory to spoil."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def set_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def change_tensors(directory: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def refused(path, match: str, capsys) -> str:
    """Both readers (metadata only, and the weights) refuse `path` with one ModelLoadError matching `match`, and
    `kvreuse generate` (run in this process: `generate_in_process`) exits 1 saying it in one line, within the time and
    memory bounds."""
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model_info(path)
    with pytest.raises(ModelLoadError, match=match):
        load_weights(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    result = generate_in_process(path, capsys)
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    print(f"{Path(path).name} {match[:40]!r}: exit {result.returncode}, {len(lines)} lines, {result.wall_s:.2f} s, "
          f"peak RSS +{result.peak_rss / 2**20:.0f} MB")
    assert result.returncode == 1 and "Traceback" not in output and len(lines) <= 3, output
    assert re.search(match, lines[-1]) and str(path) in lines[-1], output
    assert result.peak_rss <= MAX_IN_PROCESS_GROWTH, f"peak RSS grew by {result.peak_rss / 2**20:.0f} MB"
    assert result.wall_s <= MAX_IN_PROCESS_WALL_S, f"{result.wall_s:.1f} s"
    return message


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM, VmSize), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def generate_in_process(path, capsys) -> Run:
    """`kvreuse generate --model PATH hello` through cli.main in this process, its address space allowed to grow by
    at most MEMORY_LIMIT (a soft RLIMIT_AS, put back after): its exit code, output, wall time, and by how much this
    process's peak RSS grew (VmHWM, reset first through /proc/self/clear_refs)."""
    from kvreuse.cli import main

    capsys.readouterr()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _status_bytes("VmSize") + MEMORY_LIMIT
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    rss = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start, cpu = time.monotonic(), time.process_time()
    try:
        returncode = main(["generate", "--model", str(path), "hello"])
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    wall_s, cpu_s = time.monotonic() - start, time.process_time() - cpu
    growth = max(0, _status_bytes("VmHWM") - rss)
    out = capsys.readouterr()
    return Run(returncode, out.out, out.err, wall_s, growth, cpu_s)


# --- Hugging Face config.json ---------------------------------------------------------------------------------------

HF_CASES = {
    "head_count-0": (dict(num_attention_heads=0), r"num_attention_heads = 0 is not allowed \(allowed: an integer"),
    "head_count_kv-0": (dict(num_key_value_heads=0), r"num_key_value_heads = 0 is not allowed"),
    "head_dim-0": (dict(head_dim=0), r"head_dim = 0 is not allowed"),
    "kv-heads-3-of-4": (dict(num_key_value_heads=3),
                        r"num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    "vocab-smaller": (dict(vocab_size=1000),
                      r"embed_tokens.weight has shape \[\d+, 64\] \(allowed: \[1000, 64\], from vocab_size = 1000"),
    "sliding_window--1": (dict(sliding_window=-1), r"sliding_window = -1 is not allowed"),
    "context-float": (dict(max_position_embeddings=2048.5), r"max_position_embeddings = 2048.5 is not allowed"),
    "context-1e9": (dict(max_position_embeddings=1e9), r"max_position_embeddings = 1000000000(\.0)? is not allowed "
                                                       r"\(allowed: an integer from 1 to 16777216\)"),
    "context-10**9": (dict(max_position_embeddings=10**9), r"max_position_embeddings = 1000000000 is not allowed "
                                                           r"\(allowed: an integer from 1 to 16777216\)"),
    "layers-1e6": (dict(num_hidden_layers=1000000), r"num_hidden_layers = 1000000 is not allowed \(allowed: an integer "
                                                    r"from 1 to 1024\)"),
    "layers-beyond-tensors": (dict(num_hidden_layers=3), r"num_hidden_layers = 3, but the file holds tensors of 2 "
                                                         r"layer\(s\)"),
    "rope_theta-0": (dict(rope_theta=0.0), r"rope_theta = 0(\.0)? is not allowed \(allowed: a finite number above 0"),
    "rope-factor-0": (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 0.0}),
                      r"factor"),
    "epsilon-nan": (dict(rms_norm_eps=math.nan), r"rms_norm_eps = nan is not allowed"),
    "epsilon-negative": (dict(rms_norm_eps=-1e-5), r"rms_norm_eps = -1e-05 is not allowed"),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_a_hostile_hf_config_is_one_error_naming_the_key(hf_dir, name, capsys):
    changes, match = HF_CASES[name]
    set_config(hf_dir, **changes)
    refused(hf_dir, match, capsys)


def test_an_hf_tokenizer_larger_than_vocab_size_is_refused_before_serving(hf_dir):
    """The tensors and config.json agree, but the tokenizer names more tokens than the embedding has rows: ids it
    encodes would index past the embedding."""
    from transformers import AutoTokenizer

    from kvreuse.llm import LLM

    from .helpers import make_config

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(5)])
    tokenizer.save_pretrained(str(hf_dir))
    vocab_size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    with pytest.raises(ModelLoadError, match=rf"the tokenizer has {vocab_size + 5} tokens, more than the model's "
                                             rf"vocab_size = {vocab_size} embedding rows") as info:
        LLM(make_config(model__path=str(hf_dir)))
    assert "\n" not in str(info.value) and str(hf_dir) in str(info.value)


def test_a_missing_hf_tensor_is_named(hf_dir, capsys):
    change_tensors(hf_dir, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    refused(hf_dir, r"has no tensor model.layers.1.mlp.down_proj.weight", capsys)


def test_a_misshapen_hf_tensor_is_named(hf_dir, capsys):
    import torch

    def change(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    change_tensors(hf_dir, change)
    refused(hf_dir, r"tensor model.layers.0.self_attn.k_proj.weight has shape \[48, 64\] \(allowed: \[32, 64\]", capsys)


def test_a_broken_config_json_is_named(hf_dir, capsys):
    (hf_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    refused(hf_dir, r"config.json: expected a JSON object \(JSONDecodeError", capsys)


def test_a_truncated_safetensors_file_is_named(hf_dir, capsys):
    data = (hf_dir / "model.safetensors").read_bytes()
    (hf_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(hf_dir, r"model.safetensors: not a readable safetensors file", capsys)


# --- GGUF metadata --------------------------------------------------------------------------------------------------

def _set(method: str, key: str, value):
    return lambda w: getattr(w, method)(key, value)


def _replace_tensor(name: str, data):
    def change(writer):
        del writer.tensors[0][name]
        if data is not None:
            writer.add_tensor(name, data)
    return change


GGUF_CASES = {
    "head_count-0": (_set("add_uint32", "llama.attention.head_count", 0), r"llama.attention.head_count = 0 is not"),
    "head_count_kv-0": (_set("add_uint32", "llama.attention.head_count_kv", 0), r"llama.attention.head_count_kv = 0 "),
    "key_length-0": (_set("add_uint32", "llama.attention.key_length", 0), r"llama.attention.key_length = 0 is not"),
    "kv-heads-3-of-4": (_set("add_uint32", "llama.attention.head_count_kv", 3),
                        r"llama.attention.head_count_kv = 3 does not divide llama.attention.head_count = 4"),
    "context-float": (_set("add_float32", "llama.context_length", math.inf), r"llama.context_length = inf is not"),
    "context-u32-max": (_set("add_uint32", "llama.context_length", 2**32 - 1),
                        r"llama.context_length = 4294967295 is not allowed \(allowed: an integer from 1 to 16777216"),
    "layers-1e6": (_set("add_uint32", "llama.block_count", 1000000), r"llama.block_count = 1000000 is not allowed "
                                                                     r"\(allowed: an integer from 1 to 1024"),
    "layers-beyond-tensors": (_set("add_uint32", "llama.block_count", 3), r"llama.block_count = 3, but the file"),
    "freq_base-0": (_set("add_float32", "llama.rope.freq_base", 0.0), r"llama.rope.freq_base = 0.0 is not allowed"),
    "scaling-factor-0": (_set("add_float32", "llama.rope.scaling.factor", 0.0),
                         r"llama.rope.scaling.factor = 0.0 is not allowed"),
    "epsilon-nan": (_set("add_float32", "llama.attention.layer_norm_rms_epsilon", math.nan),
                    r"llama.attention.layer_norm_rms_epsilon = nan is not allowed"),
    "sliding_window--1": (_set("add_int32", "llama.attention.sliding_window", -1),
                          r"llama.attention.sliding_window = -1 is not allowed"),
    "vocab-smaller-than-tokenizer": (lambda w: w.add_token_list([f"t{i}" for i in range(49153)]),
                                     r"tokenizer.ggml.tokens has 49153 tokens, more than the embedding's 49152 rows"),
    "missing-tensor": (_replace_tensor("blk.1.ffn_down.weight", None), r"has no tensor blk.1.ffn_down.weight"),
    "misshapen-tensor": (_replace_tensor("blk.0.attn_k.weight", np.zeros((48, 64), np.float32)),
                         r"tensor blk.0.attn_k.weight has shape \[48, 64\] \(allowed: \[32, 64\]"),
}


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_a_hostile_gguf_is_one_error_naming_the_key(tiny_model_dir, real_tokenizer, tmp_path, name, capsys):
    change, match = GGUF_CASES[name]
    if name == "vocab-smaller-than-tokenizer":
        assert len(real_tokenizer.hf) == 49152  # the embedding's rows in the tiny model
    write_gguf(tiny_model_dir, "llama3", tmp_path / "model.gguf", change)
    refused(tmp_path / "model.gguf", match, capsys)


def test_an_unspoiled_gguf_of_the_tiny_model_loads(tiny_model_dir, tmp_path):
    """The GGUF the cases above spoil is itself accepted."""
    write_gguf(tiny_model_dir, "llama3", tmp_path / "model.gguf")
    assert load_model_info(tmp_path / "model.gguf").args.num_layers == 2


# --- the command line: one line, exit 1, bounded -----------------------------------------------------------------


# Runs a command under the memory limit and writes its exit code, wall time, CPU time and peak RSS: a process of its
# own, small, since a child forked from the test process starts with the test process's RSS as its high-water mark.
MEASURE = """
import json, resource, subprocess, sys, time
limit, timeout, out, *command = sys.argv[1:]
resource.setrlimit(resource.RLIMIT_AS, (int(limit), int(limit)))
start = time.monotonic()
try:
    returncode = subprocess.call(command, stdin=subprocess.DEVNULL, timeout=float(timeout))
except subprocess.TimeoutExpired:
    returncode = None
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(out, "w") as f:
    json.dump({"returncode": returncode, "wall_s": time.monotonic() - start, "peak_rss": usage.ru_maxrss * 1024,
               "cpu_s": usage.ru_utime + usage.ru_stime}, f)
"""


@dataclass
class Run:
    """A finished command: its exit code and output, its wall time, CPU time and peak RSS (its own)."""
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss: int  # bytes
    cpu_s: float


def run_kvreuse(*args: str) -> Run:
    """`python -m kvreuse ARGS` under the memory limit (RLIMIT_AS, as `prlimit --as`), killed after TIMEOUT_S."""
    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / "figures.json"
        done = subprocess.run([sys.executable, "-c", MEASURE, str(MEMORY_LIMIT), str(TIMEOUT_S), str(figures),
                               sys.executable, "-m", "kvreuse", *args], capture_output=True, text=True,
                              timeout=TIMEOUT_S + 30, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
        measured = json.loads(figures.read_text())
    assert measured["returncode"] is not None, f"killed after {TIMEOUT_S} s: {done.stdout}{done.stderr}"
    return Run(measured["returncode"], done.stdout, done.stderr, measured["wall_s"], measured["peak_rss"],
               measured["cpu_s"])


def assert_one_line_refusal(result: Run, path: Path, key: str) -> None:
    """Exit 1 with at most 3 lines, one naming the file and the key, and no traceback, within the time and RSS
    bounds."""
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    print(f"{key}: exit {result.returncode}, {len(lines)} lines, {result.wall_s:.1f} s wall, {result.cpu_s:.1f} s CPU, "
          f"peak RSS {result.peak_rss / 2**20:.0f} MB")
    assert result.returncode == 1, output
    assert "Traceback" not in output, output
    assert len(lines) <= 3, output
    assert any(str(path) in line and key in line for line in lines), output
    assert result.peak_rss <= MAX_PEAK_RSS, f"peak RSS {result.peak_rss / 2**20:.0f} MB"
    assert result.wall_s <= MAX_WALL_S, f"{result.wall_s:.1f} s"


@pytest.mark.parametrize("name, key", [
    ("head_count-0", "num_attention_heads"),
    ("context-1e9", "max_position_embeddings"),   # a float: a TypeError traceback before
    ("context-10**9", "max_position_embeddings"),  # an 8 GB RoPE table before (7.96 GB peak RSS, 27 s)
    ("layers-1e6", "num_hidden_layers"),          # hung > 120 s before
])
def test_generate_refuses_a_hostile_hf_config_in_one_line_fast_and_bounded(hf_dir, name, key):
    set_config(hf_dir, **HF_CASES[name][0])
    assert_one_line_refusal(run_kvreuse("generate", "--model", str(hf_dir), "hello"), hf_dir, key)


def test_generate_refuses_a_broken_config_json_in_one_line(hf_dir):
    (hf_dir / "config.json").write_text("{")
    assert_one_line_refusal(run_kvreuse("generate", "--model", str(hf_dir), "hello"), hf_dir, "config.json")


def test_generate_refuses_a_gguf_asking_for_a_huge_context_in_one_line(tiny_model_dir, tmp_path):
    """A u32-max context asked for 34 GB of RoPE tables."""
    write_gguf(tiny_model_dir, "llama3", tmp_path / "model.gguf", GGUF_CASES["context-u32-max"][0])
    result = run_kvreuse("generate", "--model", str(tmp_path / "model.gguf"), "hello")
    assert_one_line_refusal(result, tmp_path / "model.gguf", "llama.context_length")


def test_serve_refuses_a_hostile_model_in_one_line(hf_dir):
    set_config(hf_dir, num_key_value_heads=3)
    result = run_kvreuse("serve", "--host", "127.0.0.1", "--port", "0", "--model", str(hf_dir))
    assert_one_line_refusal(result, hf_dir, "num_key_value_heads")


# --- RoPE tables sized by the context served ----------------------------------------------------------------------


def test_rope_tables_are_as_long_as_the_context_served_with_the_same_numbers(tiny_model_dir):
    """A model's RoPE tables hold the positions served (min(server.max_tokens, its context length)), not its file's
    context length, and their rows are those of the full table."""
    import torch

    from kvreuse.model.architectures import ARCHITECTURES

    weights = load_weights(tiny_model_dir)
    model_class = ARCHITECTURES[weights.args.architecture].model_class
    full = model_class.from_weights(weights, torch.float32, torch.device("cpu"))
    served = model_class.from_weights(weights, torch.float32, torch.device("cpu"), max_positions=100)
    assert full.rotaries["full"].cos_table.shape[0] == weights.args.max_position_embeddings
    assert served.rotaries["full"].cos_table.shape[0] == 100
    for table in ("cos_table", "sin_table"):
        torch.testing.assert_close(getattr(served.rotaries["full"], table),
                                   getattr(full.rotaries["full"], table)[:100], atol=0, rtol=0)
    beyond = model_class.from_weights(weights, torch.float32, torch.device("cpu"), max_positions=10**9)
    assert beyond.rotaries["full"].cos_table.shape[0] == weights.args.max_position_embeddings


def test_an_engine_sizes_its_rope_tables_by_server_max_tokens(tiny_model_dir):
    from .helpers import greedy, tiny_llm

    llm = tiny_llm(tiny_model_dir, server__max_tokens=256)
    try:
        assert llm.engine.front_end.max_model_len == 256
        assert llm.engine.runner.model.rotaries["full"].cos_table.shape[0] == 256
        assert len(llm.generate(["hello"], greedy(3))[0].token_ids) == 3
    finally:
        llm.close()
