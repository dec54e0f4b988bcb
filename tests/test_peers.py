"""The HF transformers peer of the scenario bench, on the tiny random-weight model: same prompts and greedy
tokens as our engine, and exact prefix reuse through copied caches."""

from __future__ import annotations

import pytest

from kvreuse.bench import workloads
from kvreuse.bench.peers import HFPeer
from kvreuse.bench.scenario_bench import run_mode

from .helpers import tiny_llm

MAX_TOKENS = 8
FIDELITY_KEYS = {"top1_agreement", "mean_kl", "mean_match_len"}


def test_hf_peer_matches_our_engine_on_workload_conversations(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    conversations = workloads.chat(2, turns=2) + workloads.rag(1) + workloads.agent(1) + workloads.batch_eval(1)
    ours, exact = run_mode(llm, conversations, "no-cache", MAX_TOKENS, None)

    result, outputs = HFPeer(tiny_model_dir).run(conversations, MAX_TOKENS, prefix_reuse=False, exact=exact)

    assert set(result) == set(ours) | FIDELITY_KEYS | {"system"}
    assert result["system"] == "hf-transformers"
    assert result["total_input_tokens"] == ours["total_input_tokens"]  # the same prompts, token for token
    assert result["total_output_tokens"] == ours["total_output_tokens"] == MAX_TOKENS * len(conversations)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in exact]
    assert result["top1_agreement"] == 1 and result["mean_match_len"] == MAX_TOKENS and result["mean_kl"] < 1e-6
    assert result["exact_hit_rate"] == 0 and result["prefill_tokens_computed"] == result["total_input_tokens"]


def test_hf_prefix_reuse_skips_prefill_and_changes_no_token(tiny_model_dir):
    peer = HFPeer(tiny_model_dir)
    conversations = workloads.chat(6, turns=3)
    plain, plain_outputs = peer.run(conversations, MAX_TOKENS, prefix_reuse=False)
    reused, reused_outputs = peer.run(conversations, MAX_TOKENS, prefix_reuse=True, exact=plain_outputs)

    assert reused["exact_hit_rate"] > 0
    assert reused["exact_hit_rate"] == pytest.approx(
        sum(o.cached_tokens for o in reused_outputs) / reused["total_input_tokens"])
    assert plain["exact_hit_rate"] == 0
    assert reused["prefill_tokens_computed"] < plain["prefill_tokens_computed"] == plain["total_input_tokens"]
    assert reused["prefill_tokens_computed"] + sum(o.cached_tokens for o in reused_outputs) == \
        reused["total_input_tokens"]
    # A later turn resends the earlier turn's prompt and reply: all of it comes from the cache, but the reply's
    # last token, which was sampled and never fed back.
    assert reused_outputs[1].cached_tokens == reused_outputs[0].prompt_tokens + MAX_TOKENS - 1
    assert [o.token_ids for o in reused_outputs] == [o.token_ids for o in plain_outputs]
    assert reused["top1_agreement"] == 1 and reused["mean_kl"] < 1e-6
