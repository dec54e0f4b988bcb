"""`kvreuse fidelity`: how far approximate segment reuse moves the output, against exact recompute.

Every request of a workload runs twice in one engine, in order: exactly (no reuse at all) and with
segment reuse (the cache filled by the requests before it). Reported per mode: next-token top-1
agreement and mean KL(exact || reused) of the first-token distributions, the mean greedy-continuation
match length over the first 32 tokens, and what the reuse saved.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager

from kvreuse.bench import workloads
from kvreuse.bench.metrics import fidelity_metrics
from kvreuse.config import Config, load_config
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

CONTINUATION = 32
MODES = {
    "prefix-only": {"enabled": False},
    "shift-noguard": {"mode": "shift", "guard_margin": 0.0},
    "shift": {"mode": "shift"},
    "blend-noguard": {"mode": "blend", "guard_margin": 0.0},
    "blend": {"mode": "blend"},
    "blend-1.0": {"mode": "blend", "recompute_ratio": 1.0},
}


@contextmanager
def reuse_settings(llm: LLM, **changes):
    """Run a block with the engine's segment reuse settings (`cache.suffix.*`) changed, then restore them."""
    original = llm.engine.segment_settings
    llm.engine.set_segment_settings(original.with_changes(**changes))
    try:
        yield
    finally:
        llm.engine.set_segment_settings(original)


def run(llm: LLM, conversations: list[list[dict]], segment_overrides: dict, continuation: int = CONTINUATION) -> dict:
    """One mode over one workload, starting from an empty cache."""
    llm.engine.kv_manager.pool.reset_cache()
    params = SamplingParams(max_tokens=continuation, keep_first_logits=True, ignore_eos=True)
    pairs = []  # (exact, with reuse) outputs per request
    with reuse_settings(llm, **segment_overrides):
        for messages in conversations:
            pairs.append((llm.chat(messages, params, use_cache=False)[0], llm.chat(messages, params)[0]))
    reusing = [(e, a) for e, a in pairs if a.usage.reused_tokens]
    fidelity = (fidelity_metrics([a for _, a in reusing], [e for e, _ in reusing]) if reusing
                else dict.fromkeys(("top1_agreement", "mean_kl", "mean_match_len")))
    total = sum((a.usage for _, a in pairs), ReuseRecord())
    return {
        "requests": len(pairs), "requests_with_reuse": len(reusing),
        "median_ttft_ms": statistics.median(a.ttft_s for _, a in pairs) * 1000,
        "median_ttft_ms_exact": statistics.median(e.ttft_s for e, _ in pairs) * 1000,
        **fidelity,
        **total.as_dict(),
        "prefill_work_tokens": total.prefill_work_tokens,
    }


def fidelity_config(overrides: list[str] = (), config_file: str | None = None) -> Config:
    """The config of fidelity runs: fp32, a 4096-token context and segment reuse on, over `config_file`;
    `overrides` (section.key=value) win over both."""
    return load_config(config_file, ["model.dtype=fp32", "server.max_tokens=4096", "cache.suffix.enabled=true",
                                     *overrides])


def fidelity_report(num_requests: int = 24, seed: int = 0, modes: list[str] | None = None,
                    overrides: list[str] = (), progress=print, llm: LLM | None = None,
                    continuation: int = CONTINUATION, workload: str = "rag", config_file: str | None = None) -> dict:
    llm = llm or LLM(fidelity_config(overrides, config_file))
    conversations = workloads.WORKLOADS[workload](num_requests, seed=seed)
    report = {"workload": workload, "requests": num_requests, "seed": seed, "continuation_tokens": continuation,
              "block_size": llm.engine.block_size, "suffix": llm.engine.segment_settings.model_dump(), "modes": {}}
    for name in modes or list(MODES):
        report["modes"][name] = run(llm, conversations, MODES[name], continuation)
        progress(f"{name}: {report['modes'][name]}")
    return report


def markdown(report: dict) -> str:
    header = (f"| {report['workload']}: mode | TTFT ms (exact) | prefill work | reused | recomputed | guarded | "
              f"top-1 agreement | mean KL | greedy match (of {report['continuation_tokens']}) |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for name, m in report["modes"].items():
        lines.append(f"| {name} | {m['median_ttft_ms']:.0f} ({m['median_ttft_ms_exact']:.0f}) | "
                     f"{m['prefill_work_tokens']} | {m['reused_tokens']} | {m['recomputed_tokens']} | "
                     f"{m['guarded_requests']} | {fmt(m['top1_agreement'], '.3f')} | {fmt(m['mean_kl'], '.4f')} | "
                     f"{fmt(m['mean_match_len'], '.1f')} |")
    return "\n".join(lines)
