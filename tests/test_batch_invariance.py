"""A row's numbers do not depend on what else its step holds (docs/design/batch-invariance.md): prompt rows take one
product whatever their count (layers/row_kinds.py), run eagerly, and decode rows riding along with prompt chunks get
a forward of their own through the compiled step. So prefix caching is exact with the defaults (compile on)."""

from __future__ import annotations

import pytest
import torch

from kvreuse.layers.row_kinds import GENERATED, PROMPT, MixedRows, RowKinds, current, row_kinds
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

from .helpers import make_config
from .test_decode_graph import COMPILE_TIMEOUT_S


def test_each_row_takes_the_product_of_its_kind():
    rows = torch.arange(12.0).view(6, 2)                                              # [6, 2]
    def prompt(x): return torch.cat([x, x.sum(1, keepdim=True)], 1)                 # [T, 3], row count free
    def generated(x): return torch.cat([-x, torch.full((len(x), 1), float(len(x)))], 1)

    assert RowKinds.of([True] * 6, rows.device) is PROMPT and RowKinds.of([False] * 6, rows.device) is GENERATED
    kinds = RowKinds.of([False, True, True, False, True, False], rows.device)
    assert isinstance(kinds, MixedRows)
    out = kinds.split(rows, prompt, generated)
    assert torch.equal(out[[1, 2, 4]], prompt(rows[[1, 2, 4]]))
    assert torch.equal(out[[0, 3, 5]], generated(rows[[0, 3, 5]]))                 # 3 generated rows, not 6
    assert current() is GENERATED
    with row_kinds(kinds):
        assert current() is kinds
        with row_kinds(PROMPT):
            assert current() is PROMPT
        assert current() is kinds
    assert current() is GENERATED


@pytest.mark.slow
def test_a_prompt_row_gets_its_bits_from_a_split_linear_in_any_step():
    """bf16 with GGUF weights keeps the dense weight for prefill: a cache hit's 1, 2 or 17 suffix rows, and prompt rows
    beside decode rows, get the bits the cold prompt's 40 rows got; the decode rows those of a decode step."""
    from kvreuse.weights.gguf_weights import SplitGGUFLinear

    llm = LLM(make_config(model__dtype="bf16", engine__compile="off"))
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, SplitGGUFLinear)]
    if not linears:
        llm.engine.close()
        pytest.skip(f"no split linears here: {llm.engine.weights_description}")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        check_rows_by_kind(linears[0], torch.randn(40, linears[0].in_features, generator=g).bfloat16())  # qkv_proj
        check_rows_by_kind(linears[3], torch.randn(40, linears[3].in_features, generator=g).bfloat16())  # down_proj
    llm.engine.close()


def check_rows_by_kind(lin: torch.nn.Module, x: torch.Tensor) -> None:
    """x: [40, in], a cold prompt's rows."""
    with row_kinds(PROMPT):
        cold = lin(x)                                                                 # [40, out]
        for m in (1, 2, 17):
            assert torch.equal(lin(x[-m:]), cold[-m:]), f"{m} rows"
    decode = lin(x[:3])                                                               # a 3-row decode step
    with row_kinds(RowKinds.of([False] * 3 + [True] * 37, x.device)):
        mixed = lin(x)
    assert torch.equal(mixed[3:], cold[3:]) and torch.equal(mixed[:3], decode)


@pytest.mark.slow
def test_prefix_caching_is_exact_with_the_defaults_compile_on(compiling):
    """The README's settings (compile on, the model dtype `auto` picks here, GGUF weights): cache on == cache off, bit
    for bit, for greedy tokens, prompt logprobs and every decode logprob, at batch 8 with steps that mix prompt chunks
    and decode rows, and one request at a time. A hit's suffix once took the compiled step (Inductor's norms round
    otherwise than eager ones), decode rows beside a prompt chunk ran eagerly, and a request decoding alone took a
    one-row graph that rounded otherwise than the 2-16-row one: 20 of 24 decode logprobs moved."""
    llm = LLM(make_config(engine__num_kv_blocks=512, engine__max_num_batched_tokens=256))
    try:
        assert llm.wait_compiled(COMPILE_TIMEOUT_S) == "compiled"
        system = llm.tokenizer.encode("You answer in one short sentence, and you check your arithmetic twice. " * 6)
        prompts = [system + llm.tokenizer.encode(f" Question {i}: what is {i} times {i + 3}?") for i in range(8)]
        params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1, prompt_logprobs=1)

        def logprobs(records) -> list[float | None]:
            return [r and r.logprob for r in records]

        graph = llm.engine.runner.decode_graph
        cold = llm.generate(prompts, params, use_cache=False)
        llm.generate(prompts[:1], params)
        steps = graph.num_steps
        hit = llm.generate(prompts, params)
        assert graph.num_steps > steps and all(o.usage.cached_tokens >= 64 for o in hit[1:])
        for a, b in zip(cold, hit, strict=True):
            assert a.token_ids == b.token_ids and logprobs(a.prompt_logprobs) == logprobs(b.prompt_logprobs)
            assert logprobs(a.logprobs) == logprobs(b.logprobs)
        decoding = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)  # a hit's suffix could take the graph
        for prompt in prompts[:3]:
            alone_cold = llm.generate(prompt, decoding, use_cache=False)[0]
            alone_hit = llm.generate(prompt, decoding)[0]
            assert alone_hit.usage.cached_tokens >= 64
            assert alone_cold.token_ids == alone_hit.token_ids
            assert logprobs(alone_cold.logprobs) == logprobs(alone_hit.logprobs)
    finally:
        llm.engine.close()
