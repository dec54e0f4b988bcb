"""`kvreuse bench quant`: weight-only quantization (`model.quantization`) measured as segment reuse is: what it buys
in speed against how far it moves the output.

One engine per mode (none, int8, int4) on the same weights in the same dtype, caching off. Speed: batch-1 and
batch-8 decode and a cold 512-token prefill, as `kvreuse bench engine` measures them, the modes interleaved round by
round (the order reversed every other round, so drift cancels), round 0 a discarded warm-up, medians reported with
their ratio to none. Fidelity, against the unquantized engine: prompts of the shipped workloads (chat, rag, agent,
eval), greedy, each run once per mode: first-token top-1 agreement and mean KL(none || mode), and the greedy
continuation's match length. Also the CPU, its flags, the torch threads, and each mode's weight bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import torch

from kvreuse.bench import workloads
from kvreuse.bench.engine_bench import decode_s, machine, prefill_s, synthetic_prompt
from kvreuse.bench.metrics import fidelity_metrics
from kvreuse.bench.timing import Interleaved
from kvreuse.config import Config, load_config
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.tuning.dtype_probe import cpu_identity
from kvreuse.weights.quantize import quantization_tag, weight_bytes

MODES = ("none", "int8", "int4")
PREFILL_TOKENS = 512
DECODE_PROMPT_LEN = 128
DECODE_TOKENS = 64
DECODE_BATCHES = (1, 8)
FIDELITY_WORKLOADS = ("chat", "rag", "agent", "eval")
NUM_PROMPTS = 24
CONTINUATION = 32


def bench_config(dtype: str = "auto", overrides: Sequence[str] = ()) -> Config:
    """The config every mode's engine runs under: caching off (every prefill cold, no reuse between modes), room
    for the longest workload prompts and a 512-token prefill in one step; `overrides` win."""
    return load_config(None, [f"model.dtype={dtype}", "cache.enabled=false", "server.max_tokens=4096",
                              "engine.max_num_batched_tokens=2048", "engine.kv_cache_memory_mb=512", *overrides])


def quantized_llm(config: Config, mode: str) -> LLM:
    """An engine for `config` with `model.quantization = mode` (the engine quantizes after loading and puts the
    mode's tag in its fingerprint, so its cache keys never match an unquantized engine's)."""
    llm = LLM(config.with_changes(model=config.model.with_changes(quantization=mode)))
    llm.wait_compiled()
    return llm


def fidelity_conversations(num_prompts: int = NUM_PROMPTS, seed: int = 0) -> list[tuple[str, list[dict]]]:
    """(workload, conversation) pairs, an equal share (rounded up) from each of FIDELITY_WORKLOADS; chats are
    first and second turns of different conversations."""
    per = -(-num_prompts // len(FIDELITY_WORKLOADS))
    pairs = []
    for name in FIDELITY_WORKLOADS:
        conversations = (workloads.chat(per, turns=2, seed=seed) if name == "chat"
                         else workloads.WORKLOADS[name](per, seed=seed))
        pairs += [(name, c) for c in conversations[:per]]
    return pairs


def fidelity(outputs: dict[str, list], exact: list, names: list[str]) -> dict:
    """Per mode: fidelity_metrics against `exact`, overall and per workload."""
    result = {}
    for mode, outs in outputs.items():
        per_workload = {w: fidelity_metrics([o for o, n in zip(outs, names, strict=True) if n == w],
                                            [e for e, n in zip(exact, names, strict=True) if n == w])
                        for w in dict.fromkeys(names)}
        result[mode] = {**fidelity_metrics(outs, exact), "per_workload": per_workload}
    return result


def run(modes: Sequence[str] = MODES, dtype: str = "auto", repeats: int = 3, progress: Callable[[str], None] = print,
        *, num_prompts: int = NUM_PROMPTS, continuation: int = CONTINUATION, prefill_tokens: int = PREFILL_TOKENS,
        decode_tokens: int = DECODE_TOKENS, overrides: Sequence[str] = (), seed: int = 0,
        threads: int | None = None) -> dict:
    """Speed and fidelity of each of `modes` (fidelity against "none", which is always built as the reference).
    `overrides` (section.key=value) go to every engine's config (e.g. model.path=... for another model); `threads`
    sets torch's thread count for the run (on a machine shared with other work, 1 thread times more steadily)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(modes, dtype, repeats, progress, num_prompts, continuation, prefill_tokens, decode_tokens,
                    overrides, seed)
    finally:
        torch.set_num_threads(previous)


def _run(modes, dtype, repeats, progress, num_prompts, continuation, prefill_tokens, decode_tokens, overrides,
         seed) -> dict:
    config = bench_config(dtype, overrides)
    llms = {mode: quantized_llm(config, mode) for mode in dict.fromkeys(["none", *modes])}
    progress(f"engines built: {', '.join(llms)} ({llms['none'].engine.dtype_description})")
    report = {"suite": "quant", "repeats": repeats, "machine": {**machine(), **cpu_identity()},
              "dtype": llms["none"].engine.dtype_description, "prefill_tokens": prefill_tokens,
              "decode_prompt_tokens": DECODE_PROMPT_LEN, "decode_tokens": decode_tokens,
              "continuation_tokens": continuation, "modes": {}}
    for mode in modes:
        report["modes"][mode] = {"tag": quantization_tag(mode),
                                 "weight_bytes": weight_bytes(llms[mode].engine.runner.model)}

    samples = time_modes({m: llms[m] for m in modes}, repeats, prefill_tokens, decode_tokens, progress)
    metrics = [f"prefill_{prefill_tokens}_tok_s"] + [f"decode_b{b}_tok_s" for b in DECODE_BATCHES]
    for mode in modes:
        report["modes"][mode].update({m: samples.median(mode, m) for m in metrics})
    report["ratios"] = {f"{m} {mode}/none": samples.ratio(m, mode, "none")
                        for mode in modes if mode != "none" and "none" in modes for m in metrics}
    report["samples"] = {f"{s}/{m}": v for (s, m), v in samples.samples.items()}

    report["fidelity_prompts"], rows = measure_fidelity(llms, num_prompts, continuation, seed, progress)
    for mode in modes:
        report["modes"][mode].update(rows.get(mode, {}))
    return report


def measure_fidelity(llms: dict[str, LLM], num_prompts: int, continuation: int, seed: int,
                     progress: Callable[[str], None]) -> tuple[dict[str, int], dict[str, dict]]:
    """Every engine greedy on the same workload prompts, uncached; (prompts per workload, each quantized mode's
    `fidelity` row against the "none" engine's outputs)."""
    pairs = fidelity_conversations(num_prompts, seed)
    names, conversations = [n for n, _ in pairs], [c for _, c in pairs]
    params = SamplingParams(max_tokens=continuation, keep_first_logits=True, ignore_eos=True)
    outputs = {}
    for mode, llm in llms.items():
        outputs[mode] = llm.chat(conversations, params, use_cache=False)
        progress(f"fidelity: {mode} done ({len(conversations)} prompts)")
    exact = outputs.pop("none")
    return {w: names.count(w) for w in dict.fromkeys(names)}, fidelity(outputs, exact, names)


def time_modes(llms: dict[str, LLM], repeats: int, prefill_tokens: int, decode_tokens: int,
               progress: Callable[[str], None]) -> Interleaved:
    """Prefill and decode speed of each engine, interleaved round by round; round 0 warms up and is discarded."""
    results = Interleaved()
    tokenizer = next(iter(llms.values())).tokenizer
    for round_index in range(repeats + 1):
        order = list(llms) if round_index % 2 == 0 else list(llms)[::-1]
        for mode in order:
            llm = llms[mode]
            record = (lambda *a: results.add(*a)) if round_index else (lambda *a: None)
            ids = synthetic_prompt(tokenizer, prefill_tokens, variant=round_index)
            record(mode, f"prefill_{prefill_tokens}_tok_s", prefill_tokens / prefill_s(llm, ids))
            for batch_size in DECODE_BATCHES:
                batch = [synthetic_prompt(tokenizer, DECODE_PROMPT_LEN, variant=100 * round_index + b)
                         for b in range(batch_size)]
                seconds = decode_s(llm, batch, decode_tokens)
                record(mode, f"decode_b{batch_size}_tok_s", batch_size * (decode_tokens - 1) / seconds)
        progress(f"round {round_index}/{repeats} done")
    return results


def markdown(report: dict) -> str:
    """The report as a Markdown table, then the machine and the ratios to none."""
    speed = [k for k in next(iter(report["modes"].values())) if k.endswith("_tok_s")]
    header = ["mode", "tag", "linear+head MB", *speed, "top-1 agreement", "mean KL",
              f"greedy match (of {report['continuation_tokens']})"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for mode, row in report["modes"].items():
        weights = row["weight_bytes"]
        cells = [mode, row["tag"] or "-", f"{(weights['decoder_linears'] + weights['lm_head']) / 1e6:.1f}",
                 *(fmt(row[k], ".1f") for k in speed), fmt(row.get("top1_agreement"), ".3f"),
                 fmt(row.get("mean_kl"), ".4f"), fmt(row.get("mean_match_len"), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    m = report["machine"]
    lines += ["", f"{m['cpu']} ({', '.join(m['flags']) or 'no bf16-relevant flags'}), {m['torch_threads']} torch "
                  f"threads, torch {m['torch']}; dtype {report['dtype']}; {report['repeats']} measured rounds"]
    lines += [f"- {k}: {v:.2f}x" for k, v in report["ratios"].items() if v]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(repeats=1), indent=2))
