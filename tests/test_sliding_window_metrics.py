"""What a grouped pool (kvcache/layout.py) reports: the tokens each layer group holds, in the engine's snapshot and in
/metrics (`kvreuse:kv_tokens_in_use{group, window}`), beside the pool's capacity (`kvreuse:kv_capacity_tokens`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvreuse.server.metrics import Metrics

from .helpers import greedy
from .test_sliding_window_cache import BLOCK, WINDOW, engine, tokens


def gauges(metrics: Metrics, name: str) -> dict[tuple, float]:
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}


def test_each_group_reports_the_tokens_it_holds(grouped_gemma_dir):
    llm = engine(grouped_gemma_dir)
    eng = llm.engine
    seq = eng.add_request(tokens(9 * BLOCK + 3, 41), greedy(20))
    while seq.num_completion_tokens < 5:
        eng.step()
    snapshot = eng.stats_snapshot()
    full = -(-seq.num_computed_tokens // BLOCK) * BLOCK
    # At most the window a hit at its last two block boundaries reads, and the block being written.
    window = (-(-(WINDOW - 1) // BLOCK) + 2) * BLOCK
    assert snapshot.group_windows == (None, WINDOW, WINDOW)
    assert snapshot.group_tokens_in_use[0] == full
    assert all(0 < n <= window < full for n in snapshot.group_tokens_in_use[1:])
    assert snapshot.kv_capacity_tokens == eng.front_end.kv_capacity_tokens

    metrics = Metrics("tiny")
    metrics.observe_step(eng)
    in_use = gauges(metrics, "kvreuse:kv_tokens_in_use")
    label = lambda group, window: (("group", group), ("model_name", "tiny"), ("window", window))  # noqa: E731
    assert in_use == {label("0", "full"): full, **{label(str(g), str(WINDOW)): snapshot.group_tokens_in_use[g]
                                                     for g in (1, 2)}}
    assert gauges(metrics, "kvreuse:kv_capacity_tokens") == {(("model_name", "tiny"),): snapshot.kv_capacity_tokens}
    llm.engine.abort(seq.request_id)


def test_a_one_group_pool_reports_one_group(tiny_model_dir):
    from .helpers import tiny_llm

    eng = tiny_llm(tiny_model_dir).engine
    seq = eng.add_request("A short prompt for the pool", greedy(4))
    eng.step()
    snapshot = eng.stats_snapshot()
    assert snapshot.group_windows == (None,)
    assert snapshot.group_tokens_in_use == (-(-seq.num_computed_tokens // eng.block_size) * eng.block_size,)
