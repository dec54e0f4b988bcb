"""Segment (non-prefix) reuse: re-rotation is exact at layer 0, full recompute is exact, the repair
saves work, approximate KV never poisons the exact cache, and the fidelity guard does what it says."""

from __future__ import annotations

import pytest
import torch

from kvreuse.bench import fidelity, workloads
from kvreuse.config import load_config
from kvreuse.engine import repair
from kvreuse.llm import LLM

from .helpers import greedy, make_config

DOCS = workloads.documents()
NUM_RAG_REQUESTS = 14  # the first requests bring the documents; of 14, at least 10 reuse them


def rag_prompt(llm: LLM, question: str, docs: list[dict]) -> list[int]:
    body = "\n\n".join(f"[{i + 1}] {d['title']}\n{d['text']}" for i, d in enumerate(docs))
    return llm.tokenizer.encode(llm.engine.front_end.render_chat([
        {"role": "system", "content": workloads.RAG_SYSTEM},
        {"role": "user", "content": f"Question: {question}\n\nDocuments:\n\n{body}\n\nAnswer the question."}]))


def segment_llm(model_dir: str = "", **suffix) -> LLM:
    settings = {"model__dtype": "fp32", "engine__num_kv_blocks": 512, "server__max_tokens": 4096,
                "cache__suffix__enabled": "true"}
    if model_dir:
        settings["model__path"] = model_dir
    settings.update({f"cache__suffix__{k}": v for k, v in suffix.items()})
    return LLM(make_config(**settings))


def test_layer0_kv_of_a_shifted_block_equals_fresh_after_rerotation(tiny_model_dir, monkeypatch):
    llm = segment_llm(tiny_model_dir, mode="shift", guard_margin=0)
    first = rag_prompt(llm, "Short question?", DOCS[:2])
    second = rag_prompt(llm, "A much longer question that moves every document by a few tokens?", DOCS[:2])
    llm.generate(first, greedy(1))

    captured = {}
    copy = repair.copy_segments

    def spy(model, kv_cache, req):
        copy(model, kv_cache, req)
        bs = kv_cache.shape[3]
        positions = req.pending.segment_plan.positions()
        slots = torch.tensor([req.tables.block_table[p // bs] * bs + p % bs for p in positions])
        kv = kv_cache[0].view(2, -1, *kv_cache.shape[-2:])                           # layer 0: [2, slots, Hkv, D]
        captured.update(positions=positions, k=kv[0, slots].clone(), v=kv[1, slots].clone(),
                        plan=req.pending.segment_plan)
    monkeypatch.setattr(repair, "copy_segments", spy)
    out = llm.generate(second, greedy(1))[0]
    assert out.usage.reused_tokens > 0 and out.usage.shifted_tokens > 0
    assert any(run.start % llm.engine.block_size != run.blocks[0].position % llm.engine.block_size
               for run in captured["plan"].runs), "the test must cover a move off the block grid"

    model = llm.engine.runner.model
    with torch.inference_mode():
        positions = torch.tensor(captured["positions"])
        x = model.embed(torch.tensor([second[p] for p in captured["positions"]]))
        cos, sin = model.cos_sin(positions, x.dtype)[model.layers[0].kind]
        _, fresh_k, fresh_v = model.layers[0].qkv(x, cos, sin)
    torch.testing.assert_close(captured["k"], fresh_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(captured["v"], fresh_v, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def real_segment_llm() -> LLM:
    """The real model with segment reuse on; tests change cache.suffix.* with fidelity.reuse_settings."""
    return LLM(fidelity.fidelity_config(["engine.num_kv_blocks=512"]))


@pytest.mark.slow
def test_full_recompute_reproduces_exact_greedy_output(real_segment_llm):
    llm = real_segment_llm
    llm.engine.kv_manager.pool.reset_cache()
    with fidelity.reuse_settings(llm, recompute_ratio=1.0, guard_margin=0.0):
        llm.generate(rag_prompt(llm, "Which module sorts?", DOCS[:3]), greedy(1))
        for question, docs in [("What does document [2] describe?", [DOCS[1], DOCS[0], DOCS[2]]),
                               ("Name a function from document [1].", DOCS[:3])]:
            prompt = rag_prompt(llm, question, docs)
            exact = llm.generate(prompt, greedy(16), use_cache=False)[0]
            reused = llm.generate(prompt, greedy(16))[0]
            assert reused.usage.reused_tokens > 0
            assert reused.usage.recomputed_tokens == reused.usage.reused_tokens
            assert reused.token_ids == exact.token_ids


@pytest.mark.slow
def test_rag_reuse_halves_prefill_work_against_prefix_only(real_segment_llm):
    llm = real_segment_llm
    docs = [DOCS[4], DOCS[9]]
    first = rag_prompt(llm, "Which document mentions dialects?", docs)
    second = rag_prompt(llm, "What is the purpose of document [2]?", docs)
    outputs = {}
    for name, enabled in (("blend", True), ("prefix", False)):
        llm.engine.kv_manager.pool.reset_cache()
        with fidelity.reuse_settings(llm, enabled=enabled, guard_margin=0.0):
            llm.generate(first, greedy(1))
            outputs[name] = llm.generate(second, greedy(1))[0]
    blended, prefix = outputs["blend"], outputs["prefix"]
    work = lambda o: o.usage.computed_prompt_tokens + o.usage.recomputed_tokens
    assert blended.usage.reused_tokens > 0 and prefix.usage.reused_tokens == 0
    assert work(blended) <= 0.5 * work(prefix), (work(blended), work(prefix))
    u = blended.usage
    assert u.cached_tokens + u.reused_tokens + u.computed_prompt_tokens == u.prompt_tokens


def test_approximate_blocks_never_satisfy_an_exact_prefix_match(tiny_model_dir):
    llm = segment_llm(tiny_model_dir, guard_margin=0)
    llm.generate(rag_prompt(llm, "First?", DOCS[:2]), greedy(1))
    prompt = rag_prompt(llm, "A different question entirely?", DOCS[:2])
    first_reused = first_reused_position(llm, prompt)
    first = llm.generate(prompt, greedy(8))[0]
    assert first.usage.reused_tokens > 0 and first.usage.recomputed_tokens < first.usage.reused_tokens
    again = llm.generate(prompt, greedy(8))[0]
    # Only the exact part before the first reused token may be served from the prefix cache.
    assert first.usage.cached_tokens <= first_reused
    assert again.usage.cached_tokens <= first_reused
    llm.engine.check_integrity()


def first_reused_position(llm: LLM, prompt: list[int]) -> int:
    """Where the plan the scheduler would make for `prompt` now starts reusing segments."""
    manager = llm.engine.kv_manager
    req = llm.engine.front_end.make_sequence(prompt, greedy(1)).kv
    return manager.match(req).plan.runs[0].start


@pytest.mark.slow
def test_the_widest_guard_margin_guards_everything_and_margin_zero_nothing(real_segment_llm):
    conversations = workloads.rag(4, seed=3)
    guarded = fidelity.run(real_segment_llm, conversations, {"mode": "shift", "guard_margin": 100.0}, continuation=8)
    assert guarded["requests_with_reuse"] > 0
    assert guarded["guarded_requests"] == guarded["requests_with_reuse"]
    assert guarded["top1_agreement"] == 1.0 and guarded["mean_match_len"] == 8
    assert guarded["mean_kl"] < 1e-6
    # The discarded approximate pass counts as work: more than computing the uncached part exactly once.
    assert guarded["prefill_work_tokens"] > guarded["prompt_tokens"] - guarded["cached_tokens"]
    unguarded = fidelity.run(real_segment_llm, conversations, {"mode": "shift", "guard_margin": 0.0}, continuation=8)
    assert unguarded["requests_with_reuse"] > 0 and unguarded["guarded_requests"] == 0
    assert unguarded["prefill_work_tokens"] == unguarded["computed_prompt_tokens"]


@pytest.mark.slow
def test_fidelity_on_the_builtin_rag_workload_meets_the_stated_thresholds_under_the_rag_preset(real_segment_llm):
    rag = load_config(None, ["cache.preset=rag"]).cache.suffix
    with fidelity.reuse_settings(real_segment_llm, **rag.model_dump()):
        report = fidelity.fidelity_report(num_requests=NUM_RAG_REQUESTS, modes=["blend", "shift"],
                                          progress=lambda _: None, llm=real_segment_llm, continuation=8)
    blend, shift = report["modes"]["blend"], report["modes"]["shift"]
    # The thresholds of docs/features/segment-reuse.md (top-1 >= 0.9, KL <= 0.03), on at least 10 reusing requests:
    # top-1 moves in steps of 1/n, so only from n = 10 on does one flip stay within 0.9 and a second one fall below it:
    # the test then resolves the stated threshold, neither stricter (fewer requests) nor looser than it.
    assert blend["requests_with_reuse"] >= 10, blend
    assert blend["top1_agreement"] >= 0.9, blend
    assert blend["mean_kl"] <= 0.03, blend
    # The repair is what buys the fidelity: unrepaired shift reuse of the same requests is further off.
    assert shift["requests_with_reuse"] == blend["requests_with_reuse"]
    assert shift["mean_kl"] > blend["mean_kl"], (shift, blend)


def test_prompts_reusing_segments_share_one_forward_and_full_recompute_stays_exact(tiny_model_dir):
    llm = segment_llm(tiny_model_dir, recompute_ratio=1.0, guard_margin=0)
    orders = [DOCS[:3], [DOCS[2], DOCS[0], DOCS[1]], [DOCS[1], DOCS[2], DOCS[0]], [DOCS[0], DOCS[2], DOCS[1]]]
    prompts = [rag_prompt(llm, f"Question {i}: which document is longest?", docs) for i, docs in enumerate(orders)]
    exact = llm.generate(prompts, greedy(6), use_cache=False)
    batch_sizes = spy_batches(llm)
    # Sent together with nothing cached: the first is computed, the others wait one step and reuse its documents.
    reused = llm.generate(prompts, greedy(6))
    assert reused[0].usage.reused_tokens == 0
    assert all(o.usage.reused_tokens > 0 for o in reused[1:])
    assert all(o.usage.recomputed_tokens == o.usage.reused_tokens for o in reused)
    assert [o.token_ids for o in reused] == [o.token_ids for o in exact]
    # The three reusing prompts share one forward, and the first one's decode rides along with them.
    assert (4, 3) in batch_sizes, batch_sizes
    llm.engine.check_integrity()


def spy_batches(llm: LLM) -> list[tuple[int, int]]:
    """Records (sequences, sequences reusing segments) of every forward from now on."""
    runner, seen = llm.engine.runner, []
    run = runner.run

    def spy(seqs, segments):
        seen.append((len(seqs), sum(s.kv.pending.segment_plan is not None for s in seqs)))
        return run(seqs, segments)
    runner.run = spy
    return seen
