"""`kvreuse fidelity --kv-dtype X`: what holding K/V in X costs, against the same model holding fp32 K/V.

Two engines of one model, weights and model dtype, differing only in `cache.kv_dtype`:
- next-token distributions over long contexts: each of CONTEXT_TEXTS (~2k tokens of real text and code) is cut at
  CUTS_PER_TEXT positions from a quarter of it to its end, and the distribution after each cut is compared (top-1
  agreement, mean KL(fp32 KV || X)). The cuts of one text run in order, so each reuses the cache of the one before,
  as a cache hit within its own mode does;
- greedy continuations of CONTINUATION tokens on six parity-style prompts: identical or not, and the common prefix.
The bytes a token's K/V take in each mode are reported beside them.
"""

from __future__ import annotations

import inspect
import statistics

from kvreuse.bench.metrics import kl_divergence
from kvreuse.bench.parity import parity_texts
from kvreuse.config import Config, load_config
from kvreuse.kvcache.tokens import common_prefix_length
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

CONTEXT_TOKENS = 2048
CUTS_PER_TEXT = 32
CONTINUATION = 64
REFERENCE = "fp32"


def context_texts() -> list[str]:
    """Long texts of several kinds, each well past CONTEXT_TOKENS tokens: Python sources and their prose docstrings."""
    import argparse
    import json.decoder
    import logging
    import textwrap
    import typing
    import unittest.case
    return [inspect.getsource(module) for module in (textwrap, argparse, json.decoder, logging, typing, unittest.case)]


def prompts(llm: LLM) -> list[list[int]]:
    """The six parity-style prompts: the parity check's four, a docstring to finish and a chat question."""
    tokenizer = llm.tokenizer
    texts = [*parity_texts(tokenizer), inspect.getsource(statistics.median) + "\n# Explain the function above.\n",
             tokenizer.apply_chat_template([{"role": "user", "content": "List three uses of a KV cache, briefly."}])]
    return [tokenizer.encode(t) for t in texts]


def kv_fidelity_config(kv_dtype: str, overrides: list[str] = (), config_file: str | None = None) -> Config:
    """fp32 weights and activations, room for a context and its continuation; `overrides` win, then `kv_dtype`."""
    return load_config(config_file, ["model.dtype=fp32", "server.max_tokens=4096", "engine.num_kv_blocks=1024",
                                     *overrides, f"cache.kv_dtype={kv_dtype}"])


def first_distributions(llm: LLM, texts: list[str]) -> list:
    """The next-token logits [vocab] after each cut of each text, cut at CUTS_PER_TEXT positions up to
    CONTEXT_TOKENS tokens."""
    params = SamplingParams(max_tokens=1, keep_first_logits=True)
    logits = []
    for text in texts:
        token_ids = llm.tokenizer.encode(text)[:CONTEXT_TOKENS]
        step = len(token_ids) * 3 // 4 // CUTS_PER_TEXT
        for end in range(len(token_ids) - step * (CUTS_PER_TEXT - 1), len(token_ids) + 1, step):
            logits.append(llm.generate(token_ids[:end], params)[0].first_logits)
    return logits


def kv_fidelity_report(kv_dtype: str, overrides: list[str] = (), config_file: str | None = None,
                       progress=print) -> dict:
    llms = {name: LLM(kv_fidelity_config(name, overrides, config_file)) for name in (REFERENCE, kv_dtype)}
    try:
        texts = context_texts()
        distributions = {}
        continuations = {}
        for name, llm in llms.items():
            distributions[name] = first_distributions(llm, texts)
            params = SamplingParams(max_tokens=CONTINUATION, ignore_eos=True)
            continuations[name] = [o.token_ids for o in llm.generate(prompts(llm), params)]
            progress(f"{name}: {len(distributions[name])} distributions, {len(continuations[name])} continuations")
        reference, tested = distributions[REFERENCE], distributions[kv_dtype]
        matches = [common_prefix_length(a, b) for a, b in zip(continuations[REFERENCE], continuations[kv_dtype],
                                                              strict=True)]
        engine = llms[kv_dtype].engine
        bytes_per_token = {name: llm.engine.front_end.bytes_per_block // llm.engine.block_size
                           for name, llm in llms.items()}
        return {
            "model": engine.front_end.config.model.path or "embedded", "kv_dtype": kv_dtype, "reference": REFERENCE,
            "dtype": engine.dtype_description, "weights": engine.weights_description,
            "contexts": len(texts), "distributions": len(tested), "context_tokens": CONTEXT_TOKENS,
            "top1_agreement": statistics.mean(int(a.argmax() == b.argmax()) for a, b in zip(reference, tested,
                                                                                          strict=True)),
            "mean_kl": statistics.mean(kl_divergence(a, b) for a, b in zip(reference, tested, strict=True)),
            "max_kl": max(kl_divergence(a, b) for a, b in zip(reference, tested, strict=True)),
            "continuation_tokens": CONTINUATION, "identical_continuations": sum(m == CONTINUATION for m in matches),
            "prompts": len(matches), "match_lengths": matches,
            "bytes_per_token": bytes_per_token,
            "bytes_ratio": bytes_per_token[kv_dtype] / bytes_per_token[REFERENCE],
        }
    finally:
        for llm in llms.values():
            llm.engine.close()


def markdown(report: dict) -> str:
    r = report
    return "\n".join([
        f"| model | KV | bytes/token (vs {r['reference']}) | top-1 agreement | mean KL | max KL | "
        f"identical {r['continuation_tokens']}-token continuations |",
        "|---|---|---|---|---|---|---|",
        f"| {r['model']} ({r['dtype']}, {r['weights']}) | {r['kv_dtype']} | {r['bytes_per_token'][r['kv_dtype']]} "
        f"({r['bytes_ratio']:.3f}x) | {r['top1_agreement']:.3f} of {r['distributions']} | {r['mean_kl']:.5f} | "
        f"{r['max_kl']:.4f} | {r['identical_continuations']} of {r['prompts']} (common prefixes "
        f"{r['match_lengths']}) |",
    ])
