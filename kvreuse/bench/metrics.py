"""Serving metrics as `vllm bench serve` names them, shared by the in-process scenario run, the HF peer and the
HTTP replay, so every row of a report is computed the same way."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.tokens import common_prefix_length


def kl_divergence(exact_logits: torch.Tensor, approx_logits: torch.Tensor) -> float:
    p = torch.log_softmax(exact_logits.double(), -1)
    q = torch.log_softmax(approx_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary_ms(name: str, seconds: Sequence[float]) -> dict:
    """mean_/median_/p99_<name>_ms of durations given in seconds (None when there are none)."""
    ms = [s * 1000 for s in seconds]
    stats = {"mean": statistics.mean, "median": statistics.median, "p99": lambda v: percentile(v, 99)}
    return {f"{stat}_{name}_ms": fn(ms) if ms else None for stat, fn in stats.items()}


def serving_metrics(ttfts_s: Sequence[float], latencies_s: Sequence[float], output_tokens: Sequence[int],
                    duration: float, total_input_tokens: int | None) -> dict:
    """Throughput and latency keys of completed requests (one entry per request in each sequence)."""
    total_out = sum(output_tokens)
    tpots = [(latency - ttft) / (n - 1) for ttft, latency, n in zip(ttfts_s, latencies_s, output_tokens, strict=True)
             if n > 1]
    return {
        "completed": len(ttfts_s), "duration": duration,
        "total_input_tokens": total_input_tokens, "total_output_tokens": total_out,
        "request_throughput": len(ttfts_s) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_input_tokens + total_out) / duration if total_input_tokens else None,
        **summary_ms("ttft", ttfts_s), **summary_ms("tpot", tpots), **summary_ms("e2el", latencies_s),
    }


def fidelity_metrics(outputs: Sequence, exact: Sequence) -> dict:
    """First-token top-1 agreement and KL(exact || output), and greedy match length, against exact outputs
    (anything with `first_logits` [vocab] and `token_ids`)."""
    pairs = list(zip(outputs, exact, strict=True))
    return {
        "top1_agreement": statistics.mean(int(o.first_logits.argmax() == e.first_logits.argmax()) for o, e in pairs),
        "mean_kl": statistics.mean(kl_divergence(e.first_logits, o.first_logits) for o, e in pairs),
        "mean_match_len": statistics.mean(common_prefix_length(e.token_ids, o.token_ids) for o, e in pairs),
    }


def reuse_metrics(reuse: ReuseRecord) -> dict:
    """A run's reuse record, field by field, and the rates and prefill work derived from it."""
    return {**reuse.as_dict(), "prefill_tokens_computed": reuse.prefill_work_tokens,
            "exact_hit_rate": reuse.hit_rate, "approximate_hit_rate": reuse.approximate_hit_rate}
