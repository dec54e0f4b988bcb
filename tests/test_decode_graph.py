"""The compiled decode step (`engine.compile = decode`): the greedy tokens recorded from the eager fp32 path, at
batch 1 and batch 8 (one graph each); prompt scoring beside it; without a C++ compiler the engine falls back to
eager decoding, says why, and serves."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from kvreuse.bench.first_run import fresh_cache
from kvreuse.config import ModelConfig
from kvreuse.engine.precompile import precompile_command
from kvreuse.llm import LLM
from kvreuse.model import decode_graph
from kvreuse.model.decode_graph import BUILD_NICENESS
from kvreuse.sampling_params import SamplingParams
from tests.helpers import greedy, make_config, tiny_llm
from tests.test_decode_fastpath import BATCH_1, BATCH_1_PROMPTS, BATCH_8, NUM_TOKENS, PROMPTS

COMPILE_TIMEOUT_S = 600  # ~60 s cold for both graphs on 2 cores; the bound is for a busy CI machine


def compiled_llm(**overrides) -> LLM:
    llm = LLM(make_config(engine__compile="decode", **overrides))
    graph = llm.engine.runner.decode_graph
    assert llm.wait_compiled(COMPILE_TIMEOUT_S) == "compiled", graph.error
    return llm


def compiled_calls(run) -> tuple[object, int]:
    """run()'s result, and how many times compiled code ran in it (a step whose guards failed would run eagerly)."""
    with torch.profiler.profile() as profiler:
        result = run()
    return result, sum(e.count for e in profiler.key_averages() if e.key.startswith("## Call CompiledFxGraph"))


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_fp32_greedy_tokens(compiling):
    llm = compiled_llm(model__dtype="fp32", engine__num_kv_blocks=512)
    graph, params = llm.engine.runner.decode_graph, greedy(NUM_TOKENS)
    for i, expected in zip(BATCH_1_PROMPTS, BATCH_1, strict=True):
        outputs, calls = compiled_calls(lambda prompt=PROMPTS[i]: llm.generate(prompt, params, use_cache=False))
        assert outputs[0].token_ids == expected, f"prompt {i}"
        # Every decode step ran compiled, and the prompt eagerly (prompt rows never take the graph: its norms round
        # otherwise than eager ones, and a cache hit's suffix would get other bits than the cold prompt's rows).
        assert calls == len(expected) - 1
    steps = graph.num_steps
    outputs, calls = compiled_calls(lambda: llm.generate(PROMPTS, params, use_cache=False))
    assert [o.token_ids for o in outputs] == BATCH_8                     # 8 rows of unequal context lengths
    assert calls == graph.num_steps - steps >= NUM_TOKENS - 1
    status = llm.engine.stats_snapshot().decode_graph
    assert status.state == "compiled" and status.num_steps == graph.num_steps and status.compile_s > 0


def test_tiny_model_compiled_equals_eager_with_prompt_scoring_beside_it(compiling, tiny_model_dir):
    """A step that scores prompt rows needs their hidden states, which the graph does not return: it runs eagerly, and
    prompt logprobs equal an eager engine's; decode steps of mixed batches give the eager engine's greedy tokens."""
    llm = compiled_llm(model__path=tiny_model_dir, model__dtype="fp32", engine__num_kv_blocks=256)
    eager = tiny_llm(tiny_model_dir, engine__compile="off")
    assert eager.engine.runner.decode_graph is None
    graph = llm.engine.runner.decode_graph
    prompt = list(range(100, 140))
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=2)
    llm.generate(prompt, SamplingParams(max_tokens=4))                 # caches the prompt
    got = llm.generate(prompt, scoring)[0].prompt_logprobs
    want = eager.generate(prompt, scoring)[0].prompt_logprobs
    assert [e.token_id for e in got[1:]] == [e.token_id for e in want[1:]]
    torch.testing.assert_close([e.logprob for e in got[1:]], [e.logprob for e in want[1:]], atol=1e-4, rtol=0)
    # Sampled decode steps of the tiny model through the graph: the eager engine's greedy tokens.
    params = greedy(12)
    prompts = [prompt, prompt[:7], list(range(300, 333))]
    steps = graph.num_steps
    outputs, calls = compiled_calls(lambda: llm.generate(prompts, params))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager.generate(prompts, params)]
    assert calls == graph.num_steps - steps > 0
    # Built once: another engine on the model loads the graphs by itself, with no build.
    again = tiny_llm(tiny_model_dir, engine__compile="decode", model__dtype="fp32", engine__num_kv_blocks=256)
    loaded = again.engine.runner.decode_graph
    assert loaded.directory == graph.directory and loaded.wait(COMPILE_TIMEOUT_S) and loaded.state == "compiled"
    assert again.generate(prompts, params)[0].token_ids == outputs[0].token_ids and loaded.num_steps > 0


@pytest.fixture(scope="module")
def gemma_80_dir(tmp_path_factory, real_tokenizer) -> str:
    """A random-weight Gemma 3 of hidden size 80, whose embedding scale sqrt(80) rounds in bf16 (64's would not)."""
    from .test_architectures import build

    return str(build("gemma3", tmp_path_factory.mktemp("gemma3-80"), len(real_tokenizer.hf), real_tokenizer,
                     hidden_size=80))


@pytest.mark.parametrize("model, quantization", [("tiny_model_dir", "int8"), ("gemma_80_dir", "none")])
def test_in_bf16_the_compiled_step_gives_the_eager_steps_bits(compiling, request, model, quantization):
    """A first start decodes eagerly while the graphs build, then compiled: the switch changes no token and no
    logprob's bit. The norms, RoPE, activations and Gemma's embedding scale are kvreuse's ops in both
    (layers/pointwise.py). The Llama through int8 kernels, Gemma 3 through dense linears, with its four norms a
    layer, q/k norms, GeGLU, sliding-window layers and a scaled embedding (inductor recomputed it unrounded)."""
    sets = dict(model__path=request.getfixturevalue(model), model__dtype="bf16", model__quantization=quantization,
                engine__num_kv_blocks=256)
    llm = compiled_llm(**sets)
    eager = LLM(make_config(engine__compile="off", **sets))
    prompts = [list(range(100 + 37 * i, 130 + 41 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)
    for batch in ([prompts[0]], prompts):                                   # batch 1, then 6 rows in one graph
        got, calls = compiled_calls(lambda batch=batch: llm.generate(batch, params, use_cache=False))
        want = eager.generate(batch, params, use_cache=False)
        assert calls >= params.max_tokens - 1                               # the decode steps ran compiled
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [[e.logprob for e in o.logprobs] for o in got] == [[e.logprob for e in o.logprobs] for o in want]


def test_several_engines_in_one_process_each_run_compiled(compiling, tiny_model_dir):
    """Four models of different structure (fp32 and bf16, int8, int4: what a benchmark builds) compile 2 or 3 graphs
    each. dynamo keeps graphs per code object, and one shared list would pass its recompile limit (8) at the fourth
    engine, whose compile would then fail."""
    for quantization, dtype in (("none", "fp32"), ("none", "bf16"), ("int8", "fp32"), ("int4", "fp32")):
        llm = compiled_llm(model__path=tiny_model_dir, model__dtype=dtype, engine__num_kv_blocks=64,
                           model__quantization=quantization)
        graph = llm.engine.runner.decode_graph
        _, calls = compiled_calls(lambda llm=llm: llm.generate(list(range(100, 110)), greedy(6)))
        assert calls == graph.num_steps == 5, f"{quantization} {dtype}: a decode step ran eagerly"


def test_a_missing_compiler_is_detected():
    assert decode_graph.compiler_missing(torch.device("cpu")) is None      # this machine has one
    # inductor's own patch: a monkeypatch of the sub-config, undone, left `cpp.cxx` missing in later threads
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        assert "no C++ compiler" in decode_graph.compiler_missing(torch.device("cpu"))
    assert decode_graph.compiler_missing(torch.device("cpu")) is None


def test_without_a_compiler_the_engine_decodes_eagerly(compiling, tiny_model_dir, monkeypatch, caplog):
    # inductor's config is per thread: the fault is injected where the check runs (start(), on the caller's thread).
    monkeypatch.setattr(decode_graph, "compiler_missing", lambda device: "no C++ compiler for inductor (injected)")
    with caplog.at_level(logging.WARNING, logger=decode_graph.__name__):
        llm = tiny_llm(tiny_model_dir)
        graph = llm.engine.runner.decode_graph
        assert llm.wait_compiled(COMPILE_TIMEOUT_S) == "failed"
    assert "no C++ compiler" in graph.error and "decoding eagerly" in caplog.text
    out = llm.generate(list(range(100, 120)), greedy(5))[0]
    assert len(out.token_ids) == 5 and graph.num_steps == 0
    assert llm.engine.stats_snapshot().decode_graph.state == "failed"


def test_closing_the_engine_cancels_a_compile_still_running(compiling, tiny_model_dir, monkeypatch):
    # The compile thread is held in Python code until cancelled (a real compile may end before close() is called).
    def never_ready():
        while True:
            time.sleep(0.01)
    monkeypatch.setattr(decode_graph, "lower_priority", never_ready)
    llm = tiny_llm(tiny_model_dir)
    llm.engine.start_compile()
    graph = llm.engine.runner.decode_graph
    assert graph.state == "compiling" and not graph.wait(0.1)
    llm.close()
    assert graph.wait(0) and graph.state == "cancelled", graph.state
    assert not graph._thread.is_alive()
    out = llm.generate(list(range(100, 120)), greedy(3))[0]   # a closed engine's graph is never used
    assert len(out.token_ids) == 3 and graph.num_steps == 0


def test_a_build_of_another_model_than_the_engines_builds_nothing_and_says_so(compiling, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(fresh_cache(tmp_path)))   # nothing built yet
    llm = tiny_llm(tiny_model_dir, engine__compile="decode", model__dtype="fp32")
    graph = llm.engine.runner.decode_graph
    graph.build_command = precompile_command(ModelConfig(path=tiny_model_dir, dtype="bf16"))
    assert llm.wait_compiled(COMPILE_TIMEOUT_S) == "failed"
    assert "not the engine's (it differs in model)" in graph.error and not graph.is_built
    assert len(llm.generate(list(range(100, 120)), greedy(3))[0].token_ids) == 3 and graph.num_steps == 0


def test_closing_the_engine_kills_a_build_still_running(compiling, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(fresh_cache(tmp_path)))   # nothing built yet
    llm = tiny_llm(tiny_model_dir, engine__compile="decode")
    graph = llm.engine.runner.decode_graph
    llm.engine.start_compile()
    deadline = time.monotonic() + 60
    while graph._process is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process = graph._process
    assert process is not None and process.poll() is None, graph.error
    assert os.getpriority(os.PRIO_PROCESS, process.pid) == BUILD_NICENESS
    # its own group, to be killed with its compilers; the engine's session, whose autogroup its nice value is within
    assert os.getpgid(process.pid) == process.pid and os.getsid(process.pid) == os.getsid(0)
    llm.close()
    assert graph.wait(0) and graph.state == "cancelled" and process.poll() is not None and not graph.is_built
