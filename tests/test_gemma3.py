"""The real Gemma 3 270M (`--model gemma3-270m`, the Q4_K_M GGUF from its PyPI package) against transformers loading
the same file: greedy tokens of prompts shorter and longer than its 512-token window, a multi-turn chat under the
example template, the prefix cache on and off (the pool keeping only what the windows read), a 2,000-token shared
prefix, and segment reuse at full recompute."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from kvreuse.kernels import build as kernels
from kvreuse.llm import LLM
from kvreuse.weights.named_models import resolve_named_model

from .helpers import greedy, make_config

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "gemma3-chat.jinja"
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def hf_gemma():
    from transformers import AutoModelForCausalLM

    path = resolve_named_model("gemma3-270m")
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma() -> LLM:
    """On the defaults a user gets (model.weights = auto: the GGUF kernel where it is built; cache.sliding_kv = auto:
    the pool keeps only what the windows read), in fp32. 3072 blocks of 3 layers: 512 full-layout blocks' memory."""
    return LLM(make_config(model__path="gemma3-270m", model__dtype="fp32", model__chat_template=str(TEMPLATE),
                           engine__num_kv_blocks=3072, server__max_tokens=4096))


def hf_greedy(hf, token_ids: list[int], num_tokens: int = NUM_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([token_ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                          do_sample=False)
    return out[0, len(token_ids):].tolist()


def test_the_architecture_is_read_from_the_file(gemma):
    args = gemma.engine.runner.model.args
    assert (args.architecture, args.num_layers, args.hidden_size, args.head_dim, args.vocab_size) == \
        ("gemma3", 18, 640, 256, 262144)
    assert args.layer_kinds.count("sliding") == 15 and args.sliding_window == 512
    assert (args.rope.theta, args.sliding_rope.theta) == (1e6, 1e4)
    layout = gemma.engine.front_end.kv_layout
    assert layout.is_grouped and layout.layers_per_block == 3 and len(layout.groups) == 6


@pytest.mark.skipif(not kernels.load().isa, reason=f"no GGUF kernel here: {kernels.load().reason}")
def test_every_linear_decodes_from_the_files_blocks(gemma):
    # 18 layers x (qkv, o, gate_up, down) + the head; half the down projections are Q6_K, half of v Q8_0
    description = gemma.engine.weights_description
    assert description.startswith("gguf: 73 of 73 linears"), description
    assert all(kind in description for kind in ("Q4_K", "Q5_0", "Q6_K", "Q8_0")), description


def test_a_2000_token_shared_prefix_is_cached_with_its_windows(gemma, hf_gemma):
    """A second request sharing a 2,000-token document with the first: at least 95% of its prompt comes from the
    cache, the window blocks before the document's end among them (the first request released them to the cache as
    its own question went past), and its answer is transformers' own."""
    document = gemma.tokenizer.encode(inspect.getsource(textwrap))[:2000]
    first = document + gemma.tokenizer.encode("\nQuestion: which function wraps a paragraph? Answer:")
    second = document + gemma.tokenizer.encode("\nQuestion: what does dedent do? Answer:")
    gemma.generate(first, greedy(2))
    out = gemma.generate(second, greedy(NUM_TOKENS))[0]
    assert out.usage.cached_tokens >= 0.95 * len(second), (out.usage.cached_tokens, len(second))
    assert out.token_ids == hf_greedy(hf_gemma, second)


def test_a_2000_token_prefix_comes_back_from_the_disk_tier_with_its_windows(hf_gemma, tmp_path):
    """The windows-only pool over a disk tier: a prompt computed once, the pool's cache dropped, and the same document
    with another question loaded from the disk (whole positions: every layer's K/V), with transformers' answer."""
    llm = LLM(make_config(model__path="gemma3-270m", model__dtype="fp32", engine__num_kv_blocks=3072,
                          server__max_tokens=4096, cache__disk__path=str(tmp_path)))
    try:
        assert llm.engine.front_end.kv_layout.is_grouped
        document = llm.tokenizer.encode(inspect.getsource(textwrap))[:2000]
        llm.generate(document + llm.tokenizer.encode("\nQuestion: what does fill do? Answer:"), greedy(1))
        llm.engine.tiers.flush()
        llm.engine.reset_prefix_cache()
        second = document + llm.tokenizer.encode("\nQuestion: what does indent do? Answer:")
        out = llm.generate(second, greedy(NUM_TOKENS))[0]
        assert out.usage.cached_tokens_disk == len(document) // 16 * 16, out.usage.cached_by_tier()
        assert out.token_ids == hf_greedy(hf_gemma, second)
    finally:
        llm.engine.close()


def test_greedy_tokens_equal_transformers_within_and_past_the_window(gemma, hf_gemma):
    texts = ["The capital of France is", "def fibonacci(n):\n",
             inspect.getsource(textwrap)[:3000] + "\n# The function above"]
    token_ids = [gemma.tokenizer.encode(t) for t in texts]
    assert max(len(t) for t in token_ids) > 600, "one prompt must pass the 512-token window"
    want = [hf_greedy(hf_gemma, ids) for ids in token_ids]
    assert [o.token_ids for o in gemma.generate(token_ids, greedy(NUM_TOKENS), use_cache=False)] == want
    cached = gemma.generate(token_ids, greedy(NUM_TOKENS))   # the prompts' blocks are cached by the first run ...
    cached = gemma.generate(token_ids, greedy(NUM_TOKENS))   # ... and hit by this one
    assert [o.token_ids for o in cached] == want
    assert cached[2].usage.cached_tokens >= 512, "the long prompt's blocks, past the window, came from the cache"


def test_a_multi_turn_chat_with_a_template_file(gemma, hf_gemma):
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    for turn, question in enumerate(["What is the capital of France?", "And of Italy?", "Which one is larger?"]):
        messages.append({"role": "user", "content": question})
        prompt = gemma.engine.front_end.tokenize_chat(messages)
        assert prompt[0] == 2 and prompt.count(2) == 1, "one <bos>, written by the template"
        out = gemma.generate(prompt, greedy(NUM_TOKENS))[0]
        assert out.token_ids == hf_greedy(hf_gemma, prompt), f"turn {turn}"
        if turn:
            assert out.usage.cached_tokens >= 16, "the earlier turns are a cached prefix"
        messages.append({"role": "assistant", "content": gemma.tokenizer.decode(out.token_ids)})


def test_the_simulators_tokenize_chat_as_the_engine_does(gemma):
    """`kvreuse analyze`, the block-size sweep and `bench scenario-trace` tokenize a conversation as a chat request
    is: one <bos>, the template's."""
    from kvreuse.analyze import tokenize

    messages = [{"role": "user", "content": "Hello there"}]
    token_ids = tokenize(gemma.tokenizer, messages, False)
    assert token_ids == gemma.engine.front_end.tokenize_chat(messages) and token_ids.count(2) == 1


def test_segment_reuse_at_full_recompute_is_exact(gemma, hf_gemma):
    llm = LLM(make_config(model__path="gemma3-270m", model__dtype="fp32", engine__num_kv_blocks=256,
                          cache__suffix__enabled="true", cache__suffix__recompute_ratio="1.0",
                          cache__suffix__guard_margin="0"))
    document = inspect.getsource(textwrap)[3000:4500]
    llm.generate(gemma.tokenizer.encode("Read this:\n" + document), greedy(1))
    second = gemma.tokenizer.encode("Now read the following text carefully:\n" + document)
    out = llm.generate(second, greedy(NUM_TOKENS))[0]
    assert out.usage.reused_tokens > 0
    assert out.token_ids == hf_greedy(hf_gemma, second)


def test_the_readmes_gemma_command_serves_chat(tmp_path):
    """`kvreuse serve --model gemma3-270m --chat-template examples/gemma3-chat.jinja` exactly as the README shows it,
    answering the openai client; the second turn starts from the cached first."""
    import shlex

    import openai

    from .server_process import start_server
    from .test_server import readme_block

    command = next(line for line in readme_block("bash", "--model gemma3-270m").splitlines() if "serve" in line)
    args = shlex.split(command.split("#")[0])
    assert args[:2] == [".venv/bin/kvreuse", "serve"]
    with start_server(*args[2:], log_path=tmp_path / "gemma.log", ready_timeout=300) as server:
        assert server.model == "gemma3-270m"  # the name given, as the README says clients send it
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0,
                               http_client=openai.DefaultHttpxClient(trust_env=False))
        messages = [{"role": "user", "content": "Name three colours."}]
        first = client.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=12, temperature=0)
        assert first.choices[0].message.content
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And three animals?"}]
        second = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0)
        assert second.choices[0].message.content
        assert second.usage.prompt_tokens_details.cached_tokens >= 16
        client.close()
