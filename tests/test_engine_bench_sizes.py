"""`kvreuse bench engine` sizes its engines' pools for every timed request, on a sliding-window model too, whose
window groups hold blocks of their own (a Gemma 3 bench once stopped at its first prefill: "does not fit")."""

from kvreuse.bench.engine_bench import KvreuseSystem, Target, synthetic_prompt
from kvreuse.bench.engine_sizes import Sizes


def test_every_timed_request_fits_a_grouped_pool(grouped_gemma_dir):
    sizes = Sizes(prefill_lengths=(100,), decode_prompt_len=40, decode_tokens=4, decode_batches=(1, 3))
    system = KvreuseSystem(Target(grouped_gemma_dir, "cpu", sizes), compile="off")
    front = system.llm.engine.front_end
    assert front.kv_layout.is_grouped
    assert front.kv_capacity_tokens >= 101
    tokenizer = front.tokenizer
    assert system.prefill(synthetic_prompt(tokenizer, 100, 0)) > 0
    batch = [synthetic_prompt(tokenizer, 40, v) for v in range(3)]
    assert system.decode(batch, 4) > 0
