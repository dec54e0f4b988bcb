"""Greedy parity with Hugging Face transformers on the same weights, device and dtype.

Our engine decodes a batch of prompts (short, code, long text, a chat turn) together; transformers decodes each alone,
in a plain greedy loop over its own forward and KV cache, keeping its logits. In fp32 the tokens must be equal. In
bf16 two correct implementations round differently, so a divergence passes only at a near-tie: where, in HF's own
logits at the first position the two disagree, our token trails HF's by at most TIE_STEPS steps of bf16 at HF's top
logit (a step is 2^-7 of its power of two: 0.0625 for logits of 8 to 16).
"""

from __future__ import annotations

import inspect
import math
import textwrap

import torch

from kvreuse.bench.check_steps import CheckFailed
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

TIE_STEPS = {"fp32": 0, "bf16": 2}  # the largest gap a divergence may have, in steps of the dtype at HF's top logit
MANTISSA_BITS = {"fp32": 23, "bf16": 7}


def parity_texts(tokenizer) -> list[str]:
    """Prompts of 5 to ~700 tokens: plain text, code, real long text, a chat turn under the chat template."""
    long_text = inspect.getsource(textwrap)[:2600]
    return ["The capital of France is",
            "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
            long_text + "\n# The function above",
            tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])]


@torch.inference_mode()
def hf_greedy(model, ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """`num_tokens` greedy tokens after `ids` (EOS does not stop it), and the fp32 logits [vocab] (on the CPU) each
    was chosen from."""
    from transformers import DynamicCache

    from kvreuse.bench.peers import cache_argument

    device = next(model.parameters()).device
    with_cache = {cache_argument(model): DynamicCache(config=model.config), "use_cache": True}
    inputs, tokens, logits = torch.tensor([ids], device=device), [], []
    for _ in range(num_tokens):
        row = model(input_ids=inputs, logits_to_keep=1, **with_cache).logits[0, -1].float()
        logits.append(row.cpu())
        tokens.append(int(row.argmax()))
        inputs = torch.tensor([[tokens[-1]]], device=device)
    return tokens, logits


def step_of(value: float, dtype: str) -> float:
    """The spacing of `dtype`'s numbers at `value` (its unit in the last place)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0 ** -126))) - MANTISSA_BITS[dtype])


def compare(ours: list[int], theirs: list[int], their_logits: list[torch.Tensor], dtype: str) -> dict:
    """Where two greedy continuations part, and how close HF's own choice was there: `gap` (HF's logit of its token
    minus ours), `steps` (that gap in steps of `dtype` at HF's logit) and `rank` (of our token in HF's logits);
    `passed` if equal, or parted at a near-tie (at most TIE_STEPS[dtype] steps)."""
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if first is None:
        return {"equal": True, "passed": True}
    row = their_logits[first]
    top = float(row[theirs[first]])
    gap = top - float(row[ours[first]])
    steps = gap / step_of(top, dtype)
    rank = int((row > row[ours[first]]).sum()) + 1
    return {"equal": False, "first_divergence": first, "gap": gap, "steps": steps, "rank": rank,
            "passed": steps <= TIE_STEPS[dtype]}


def engine_config(model_dir: str, device: str, dtype: str, compile: str = "off", *sets: str):
    """Our engine on `model_dir`, caching off unless `sets` turn it on, room for the checks' prompts."""
    return load_config(None, [f"model.path={model_dir}", f"model.device={device}", f"model.dtype={dtype}",
                              f"engine.compile={compile}", "cache.enabled=false", "engine.num_kv_blocks=1024",
                              "server.max_tokens=4096", *sets])


def greedy_parity(model_dir: str, device: str, dtype: str, num_tokens: int, compile: str = "off",
                  compile_timeout_s: float = 300.0) -> dict:
    """Our tokens against HF's on every parity prompt; CheckFailed naming the prompts that parted too far. With
    `compile="decode"` the compiled step must be ready and run."""
    from kvreuse.bench.peers import load_hf

    with LLM(engine_config(model_dir, device, dtype, compile)) as llm:
        prompts = [llm.tokenizer.encode(t) for t in parity_texts(llm.tokenizer)]
        compiled = llm.wait_compiled(compile_timeout_s)
        if compile != "off" and compiled != "compiled":
            raise CheckFailed(f"the decode step did not compile: {compiled} "
                              f"({llm.engine.runner.decode_graph.error})")
        outputs = llm.generate(prompts, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
        compiled_steps = llm.engine.runner.decode_graph.num_steps if compile != "off" else 0
    if compile != "off" and not compiled_steps:
        raise CheckFailed("no decode step ran through the compiled graph")
    model = load_hf(model_dir, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], device)[0]
    rows = []
    for ids, out in zip(prompts, outputs, strict=True):
        theirs, logits = hf_greedy(model, ids, num_tokens)
        rows.append({"prompt_tokens": len(ids), "distinct_tokens": len(set(theirs)),
                     **compare(out.token_ids, theirs, logits, dtype)})
    details = {"model": model_dir, "device": device, "dtype": dtype, "tokens": num_tokens, "compile": compile,
               "compiled_steps": compiled_steps, "prompts": rows}
    parted = [f"{r['prompt_tokens']}-token prompt at token {r['first_divergence']} (gap {r['gap']:.3g} = "
              f"{r['steps']:.1f} {dtype} steps, rank {r['rank']})" for r in rows if not r["passed"]]
    if parted:
        raise CheckFailed("greedy tokens differ from HF's: " + "; ".join(parted), details)
    return details
