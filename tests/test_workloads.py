"""Workload generators: deterministic under a seed, and shaped the way each scenario shares text."""

from __future__ import annotations

import pytest

from kvreuse.bench import workloads


@pytest.mark.parametrize("make", [workloads.rag, workloads.batch_eval, workloads.chat, workloads.agent,
                                  workloads.prefix_repetition, workloads.generated_shared_prefix])
def test_deterministic_under_a_seed(make):
    assert make(seed=1) == make(seed=1)
    assert make(seed=1) != make(seed=2)


def text(request) -> str:
    return request if isinstance(request, str) else "\n".join(m["content"] for m in request)


def test_rag_moves_the_same_documents_around():
    requests = [text(r) for r in workloads.rag(24)]
    doc = workloads.documents()[0]["text"]
    offsets = {r.index(doc) for r in requests if doc in r}
    assert len(offsets) >= 2, "a document must appear at more than one position"


def test_eval_and_agent_keep_a_long_fixed_tail_after_varying_text():
    cases = ((workloads.batch_eval(12), workloads.EVAL_RUBRIC), (workloads.agent(12), workloads.AGENT_TOOLS))
    for requests, tail in cases:
        texts = [text(r) for r in requests]
        assert all(t.endswith(tail) for t in texts)
        assert all(len(tail) > 0.5 * len(t) for t in texts), "the shared text is the larger part of each prompt"
        assert len({t[: -len(tail)] for t in texts}) > 1
        assert len({len(t) - len(tail) for t in texts}) > 1, "the fixed part must move, not sit at one offset"


def test_chat_turns_extend_the_previous_turn_and_repeat_the_tail_instruction():
    requests = workloads.chat(8, turns=4)
    for earlier, later in zip(requests[:3], requests[1:4], strict=True):
        assert later[: len(earlier)] == earlier and len(later) == len(earlier) + 2
    assert all(m["content"].endswith(workloads.CHAT_TAIL) for r in requests for m in r if m["role"] == "user")


def test_prefix_shapes():
    prompts = workloads.prefix_repetition(24, num_prefixes=4)
    assert len({p.split("\n")[0] for p in prompts}) == 4
    groups = workloads.generated_shared_prefix(num_groups=3, prompts_per_group=5)
    assert len(groups) == 15 and len({r[0]["content"] for r in groups}) == 3


def test_scenario_bench_quick_writes_valid_json_with_every_key_and_plots(tiny_model_dir, tmp_path):
    import json

    from kvreuse.cli import main

    # guard_margin 0: a random-weight model's first tokens are all near-ties, which the guard would recompute.
    assert main(["bench", "scenario", "eval", "--quick", "--model", tiny_model_dir, "--out", str(tmp_path),
                 "--concurrency", "2", "--set", "cache.suffix.guard_margin=0"]) == 0
    report = json.loads((tmp_path / "scenario.json").read_text())
    modes = report["scenarios"]["eval"]
    assert list(modes) == ["no-cache", "prefix", "shift", "blend", "hf"]
    keys = {"completed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "prefill_tokens_computed", "exact_hit_rate",
            "approximate_hit_rate", "peak_kv_bytes", "peak_rss_bytes", "ttft_vs_no_cache", "throughput_vs_no_cache",
            "work_vs_prefix"}
    assert all(keys <= set(r) for r in modes.values())
    assert all({"top1_agreement", "mean_kl", "mean_match_len"} <= set(modes[m]) for m in ("blend", "hf"))
    assert modes["no-cache"]["exact_hit_rate"] == 0 and modes["no-cache"]["completed"] == 4
    assert modes["no-cache"]["ttft_vs_no_cache"] == 1.0 and modes["prefix"]["work_vs_prefix"] == 1.0
    # The rubric at the tail is reused by segment reuse, never by prefix caching.
    assert modes["blend"]["approximate_hit_rate"] > 0 and modes["prefix"]["approximate_hit_rate"] == 0
    assert modes["shift"]["prefill_tokens_computed"] < modes["prefix"]["prefill_tokens_computed"]
    # The HF peer computes the same prompts without reuse and, in fp32, greedily agrees with exact recompute.
    assert modes["hf"]["total_input_tokens"] == modes["no-cache"]["total_input_tokens"]
    assert modes["hf"]["prefill_tokens_computed"] == modes["no-cache"]["prefill_tokens_computed"]
    assert modes["hf"]["top1_agreement"] == 1.0
    sweep = report["block_size_sweep"]
    assert sweep["block_sizes"][0] == 8 and 0 <= sweep["scenarios"]["eval"]["with_segments"][0] <= 1
    for png in ("scenario_ttft.png", "hit_rate_vs_block_size.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_live_replies_resend_the_reply_given_and_keep_canned_text_until_then():
    first, second, third = workloads.chat(3, turns=3)
    replies = workloads.LiveReplies()
    assert replies.fill(second) == second  # nothing recorded yet: the canned reply stays
    replies.record(first, "reply one")
    filled = replies.fill(second)
    assert filled[len(first)] == {"role": "assistant", "content": "reply one"}
    assert filled[: len(first)] == first and filled[len(first) + 1:] == second[len(first) + 1:]
    replies.record(second, "reply two")
    assert [m["content"] for m in replies.fill(third) if m["role"] == "assistant"] == ["reply one", "reply two"]
    single = workloads.batch_eval(1)[0]
    assert replies.fill(single) == single
