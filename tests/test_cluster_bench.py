"""`kvreuse bench cluster`'s verdicts and table, from a report's numbers (the run itself starts real servers: it is
measured by hand, see docs/benchmarks.md)."""

from __future__ import annotations

from kvreuse.bench import cluster_bench


def result(hit_rate: float, ttft_ms: float, affinity: float | None = None) -> dict:
    return {"exact_hit_rate": hit_rate, "mean_ttft_ms": ttft_ms, "p99_ttft_ms": 2 * ttft_ms,
            "request_throughput": 1.0, "session_affinity": affinity, "failed": 0}


def servers(aware: tuple[float, float], probe_aware: float = 12.0) -> dict:
    return {"single": {"probe_ttft_ms": 10.0, "scenarios": {"document-chat": result(0.60, 100),
                                                             "agent": result(0.1, 90)}},
            "cache_aware": {"probe_ttft_ms": probe_aware,
                            "scenarios": {"document-chat": result(*aware, 1.0), "agent": result(0.1, 95, 1.0)}},
            "round_robin": {"probe_ttft_ms": 12.0,
                            "scenarios": {"document-chat": result(0.30, 200, 0.5), "agent": result(0.05, 99, 1.0)}}}


def test_targets_met_and_missed_by_their_own_margins():
    met = cluster_bench.targets(servers((0.58, 110)))
    assert all(t["met"] for t in met.values())
    missed = cluster_bench.targets(servers((0.44, 130), probe_aware=31.0))
    assert [t["met"] for t in missed.values()] == [False, False, False, False]
    assert missed["hit rate within 5 points of the single server (document-chat)"]["margin"] == 0.6 - 0.44
    assert missed["Ray path adds < 20 ms per request"]["margin"] == 31.0 - 10.0 - 20.0


def test_markdown_has_a_row_per_server_and_scenario():
    report = {"replicas": 2, "requests": 24, "turns": 4, "max_tokens": 16,
              "cpu": {"cpu": "Test CPU", "machine": "x86_64", "flags": ["avx2"]},
              "servers": servers((0.58, 110)), "targets": cluster_bench.targets(servers((0.58, 110)))}
    table = cluster_bench.markdown(report)
    assert table.count("\n| ") == 6 and "| cache_aware | document-chat | 58.0% | 110 | 220 | 1.00 | 1.00 | 0 |" in table
    assert "Test CPU" in table and "Ray path adds < 20 ms per request: met" in table
