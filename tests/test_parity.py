"""Our paged-KV Llama against Hugging Face transformers on the same weights: greedy tokens must match."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from kvreuse.sampling_params import SamplingParams
from kvreuse.weights.loader import embedded_model_path

from .helpers import greedy, tiny_llm

NUM_TOKENS = 32


def long_text(num_chars: int) -> str:
    """Real, varied text: the source of a standard-library module."""
    return inspect.getsource(textwrap)[:num_chars]


def prompts(tokenizer) -> list[str]:
    chat = lambda content: tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        long_text(2600) + "\n# The function above",
        chat("What is the capital of France?"),
        chat("Write a haiku about the sea."),
        chat("Summarise what this Python module does:\n\n" + long_text(3000)),
    ]


def hf_greedy(model, token_ids: list[int], eos_token_id: int) -> list[int]:
    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return out[0, len(token_ids):].tolist()


@pytest.mark.slow
def test_greedy_parity_with_transformers_on_the_embedded_gguf(real_llm):
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    texts = prompts(real_llm.tokenizer)
    token_ids = [real_llm.tokenizer.encode(t) for t in texts]
    assert max(len(t) for t in token_ids) > 600 and min(len(t) for t in token_ids) < 20
    ours = real_llm.generate(token_ids, SamplingParams(max_tokens=NUM_TOKENS))
    for ids, out in zip(token_ids, ours, strict=True):
        expected = hf_greedy(hf, ids, real_llm.tokenizer.hf.eos_token_id)
        assert out.token_ids == expected, f"diverged on a {len(ids)}-token prompt"


def test_greedy_parity_with_transformers_on_an_hf_directory(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    llm = tiny_llm(tiny_model_dir, engine__num_kv_blocks=128)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for text in ["Hello there", "A longer prompt about caches, blocks and positions " * 12]:
        ids = llm.tokenizer.encode(text)
        out = llm.generate(ids, greedy(NUM_TOKENS))[0]
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                          do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref
