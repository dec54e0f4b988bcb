"""The fast decode paths on the embedded model give the pure-torch fp32 path's greedy tokens, at batch 1 and 8.

Each configuration runs in its own process, as users run it, because what it tests is decided at load: the
reference (`KVREUSE_CPU_KERNELS=0`, dense weights, eager: no kernel of ours at all), the default (GGUF blocks,
fused attention, compiled decode step), the AVX2 variant on a CPU that also has AVX-512, and a CPU without the fast
instructions (`ATEN_CPU_CAPABILITY=default`), which must fall back to the dense weights. On the default path a torch
profiler counts the kernels' calls per decode step and the graph counts its steps, so that a path that silently fell
back fails here rather than passing as the reference; the eager variants report which kernel each linear was given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvreuse.kernels import build as kernels

from .test_parity import long_text

NUM_TOKENS = 16
NUM_B1 = 4  # prompts run one at a time (of the eight that run as one batch)
NUM_LINEARS = 30 * 4 + 1  # SmolLM2-135M: four fused linears per layer, and the LM head
NUM_LAYERS = 30

WORKER = r"""
import json, sys
from torch.profiler import ProfilerActivity, profile
from kvreuse.config import load_config
from kvreuse.kernels import build as kernels
from kvreuse.llm import LLM
from kvreuse.weights.gguf_weights import GGUFLinear
from kvreuse.sampling_params import SamplingParams

sets, prompts, num_tokens, NUM_B1, profiled = json.loads(sys.argv[1])
with LLM(load_config(None, sets)) as llm:
    compiled = llm.wait_compiled(600)
    graph = llm.engine.runner.decode_graph
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    isas = [m.isa for m in llm.engine.runner.model.modules() if isinstance(m, GGUFLinear)]
    report = {"weights": llm.engine.weights_description, "compiled": compiled, "gguf_isas": sorted(set(isas)),
              "kernels_loaded": kernels.load().loaded}
    for name, batches in (("b1", [[p] for p in prompts[:NUM_B1]]), ("b8", [prompts])):
        steps_before = graph.num_steps if graph else 0
        if profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                outputs = [o for batch in batches for o in llm.generate(batch, params, use_cache=False)]
            counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("kvreuse_cpu::")}
        else:
            outputs = [o for batch in batches for o in llm.generate(batch, params, use_cache=False)]
            counts = None
        report[name] = {"tokens": [o.token_ids for o in outputs], "ops": counts,
                        "prompt_tokens": [o.usage.prompt_tokens for o in outputs],
                        "graph_steps": (graph.num_steps if graph else 0) - steps_before}
print("REPORT " + json.dumps(report))
"""


def prompts() -> list[str]:
    """test_parity's prompts (short and 600+ tokens, plain and chat-templated), eight of them for batch 8; the
    first NUM_B1 are one of each kind."""
    chat = lambda content: ("<|im_start|>user\n" + content + "<|im_end|>\n<|im_start|>assistant\n")
    return ["The capital of France is", long_text(2600) + "\n# The function above",
            chat("What is the capital of France?"),
            chat("Summarise what this Python module does:\n\n" + long_text(3000)),
            "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
            chat("Write a haiku about the sea."), "Once upon a time, in a village by the sea,",
            chat("List three prime numbers.")]


def run_worker(sets: list[str], env: dict[str, str], profiled: bool = False) -> dict:
    """One configuration's report; `profiled` counts our kernels' calls with torch's profiler (cheap on a compiled
    step, a minute more on eager ones)."""
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps([["model.dtype=fp32", *sets], prompts(),
                                                                     NUM_TOKENS, NUM_B1, profiled])],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


@pytest.fixture(scope="module")
def reference() -> dict:
    report = run_worker(["model.weights=dense", "engine.compile=off"], {"KVREUSE_CPU_KERNELS": "0"})
    assert report["weights"] == "dense" and not report["kernels_loaded"], "the reference could run our kernels"
    return report


def decode_steps(report: dict, batch: str) -> int:
    """Decode steps of a phase: each prompt's tokens after its first, the batch's sequences stepping together."""
    return (NUM_TOKENS - 1) * (NUM_B1 if batch == "b1" else 1)


def compiled_steps(report: dict, batch: str) -> int:
    """The steps the compiled graphs run in a phase: every decode step, and no prompt step (prompt rows run eagerly,
    so that a cache hit's suffix gets the cold prompt's bits: docs/design/batch-invariance.md)."""
    return decode_steps(report, batch)


needs_kernel = pytest.mark.skipif(not kernels.load().isa, reason=f"no GGUF kernel here: {kernels.load().reason}")


@pytest.mark.slow
@needs_kernel
def test_the_default_fast_path_gives_the_reference_tokens(reference):
    report = run_worker([], {}, profiled=True)
    assert report["weights"].startswith("gguf: 121 of 121 linears"), report["weights"]
    assert report["compiled"] == "compiled"
    for batch in ("b1", "b8"):
        steps = decode_steps(report, batch)
        phase = report[batch]
        assert phase["graph_steps"] == compiled_steps(report, batch), f"{batch}: a step ran eagerly"
        assert phase["ops"].get("kvreuse_cpu::gguf_linear", 0) >= NUM_LINEARS * steps, phase["ops"]
        assert phase["ops"].get("kvreuse_cpu::decode_attention", 0) >= NUM_LAYERS * steps, phase["ops"]
        assert phase["tokens"] == reference[batch]["tokens"], f"{batch}: greedy tokens differ from the reference"


@pytest.mark.slow
@pytest.mark.skipif(kernels.load().isa < 2, reason="needs an AVX-512 CPU to run the AVX2 variant beside it")
def test_the_avx2_variant_gives_the_reference_tokens(reference):
    report = run_worker(["engine.compile=off"], {"ATEN_CPU_CAPABILITY": "avx2"})
    assert "avx2" in report["weights"] and report["gguf_isas"] == [1], report
    for batch in ("b1", "b8"):
        assert report[batch]["tokens"] == reference[batch]["tokens"]


@pytest.mark.slow
def test_a_cpu_without_the_fast_instructions_falls_back_to_the_same_tokens(reference):
    report = run_worker(["engine.compile=off"], {"ATEN_CPU_CAPABILITY": "default"})
    assert report["weights"] == "dense (ATEN_CPU_CAPABILITY=default)" or "build failed" in report["weights"], \
        report["weights"]
    assert report["gguf_isas"] == [], "a GGUF kernel was given to a CPU said to have no AVX2"
    for batch in ("b1", "b8"):
        assert report[batch]["tokens"] == reference[batch]["tokens"]
