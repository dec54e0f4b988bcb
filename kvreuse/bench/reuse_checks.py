"""The reuse that must change no output, checked on any model and device: greedy tokens with the prefix cache on
equal those with it off, and segment reuse at `recompute_ratio = 1.0` (everything reused is recomputed) equals exact
recompute. Both in fp32, where output must not depend on what was cached."""

from __future__ import annotations

from kvreuse.bench import workloads
from kvreuse.bench.check_steps import CheckFailed
from kvreuse.bench.parity import engine_config, parity_texts
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams


def _greedy(num_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, ignore_eos=True)


def prefix_cache_parity(model_dir: str, device: str, num_tokens: int) -> dict:
    """Prompts sharing a long prefix, each sent alone with the cache off, then one after another with it on (each
    reusing the ones before), then all at once again on a warm cache: the same tokens every time."""
    with LLM(engine_config(model_dir, device, "fp32", "off", "cache.enabled=true")) as llm:
        shared = parity_texts(llm.tokenizer)[2]
        prompts = [llm.tokenizer.encode(shared + ending) for ending in ("\n# First", "\n# Second", "\n# Third one")]
        cold = [llm.generate(p, _greedy(num_tokens), use_cache=False)[0] for p in prompts]
        one_by_one = [llm.generate(p, _greedy(num_tokens))[0] for p in prompts]
        together = llm.generate(prompts, _greedy(num_tokens))
    cached = [o.usage.cached_tokens for o in one_by_one]
    details = {"prompt_tokens": [len(p) for p in prompts], "cached_tokens_one_by_one": cached,
               "cached_tokens_together": [o.usage.cached_tokens for o in together]}
    if not all(cached[1:]) or not all(details["cached_tokens_together"]):
        raise CheckFailed("the prefix cache served nothing: the check compared nothing", details)
    for name, outputs in (("one by one", one_by_one), ("together", together)):
        differ = [i for i, (a, b) in enumerate(zip(cold, outputs, strict=True)) if a.token_ids != b.token_ids]
        if differ:
            raise CheckFailed(f"cache on ({name}) differs from cache off on prompts {differ}", details)
    return details


def rag_prompt(llm: LLM, question: str, docs: list[dict]) -> list[int]:
    body = "\n\n".join(f"[{i + 1}] {d['title']}\n{d['text']}" for i, d in enumerate(docs))
    return llm.engine.front_end.tokenize_chat([
        {"role": "system", "content": workloads.RAG_SYSTEM},
        {"role": "user", "content": f"Question: {question}\n\nDocuments:\n\n{body}\n\nAnswer the question."}])


def full_recompute_is_exact(model_dir: str, device: str, num_tokens: int) -> dict:
    """RAG prompts whose documents come in other orders: each later one reuses the earlier ones' documents as
    segments, all of it recomputed (`recompute_ratio = 1.0`, no guard); its tokens must equal exact recompute's."""
    sets = ["cache.enabled=true", "cache.suffix.enabled=true", "cache.suffix.recompute_ratio=1.0",
            "cache.suffix.guard_margin=0"]
    docs = workloads.documents()
    orders = [docs[:3], [docs[2], docs[0], docs[1]], [docs[1], docs[2], docs[0]]]
    with LLM(engine_config(model_dir, device, "fp32", "off", *sets)) as llm:
        prompts = [rag_prompt(llm, f"Question {i}: which document is longest?", o) for i, o in enumerate(orders)]
        exact = llm.generate(prompts, _greedy(num_tokens), use_cache=False)
        reused = [llm.generate(p, _greedy(num_tokens))[0] for p in prompts]
    usage = [o.usage for o in reused]
    details = {"prompt_tokens": [len(p) for p in prompts], "reused_tokens": [u.reused_tokens for u in usage],
               "recomputed_tokens": [u.recomputed_tokens for u in usage]}
    if not all(u.reused_tokens for u in usage[1:]):
        raise CheckFailed("a later prompt reused no segment: the check compared nothing", details)
    if any(u.recomputed_tokens != u.reused_tokens for u in usage):
        raise CheckFailed("recompute_ratio = 1.0 left reused tokens unrecomputed", details)
    differ = [i for i, (a, b) in enumerate(zip(exact, reused, strict=True)) if a.token_ids != b.token_ids]
    if differ:
        raise CheckFailed(f"segment reuse at recompute_ratio = 1.0 differs from exact on prompts {differ}", details)
    return details
