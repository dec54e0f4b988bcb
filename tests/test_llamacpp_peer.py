"""The llama.cpp peer of `kvreuse bench engine` runs in a worker process: a worker that crashes or errs is a failed
row of the table, never the end of the bench. (The worker itself needs llama-cpp-python, `make bench-peers`; these
tests give the peer workers that fail as llama.cpp did, which a working build cannot.)"""

from __future__ import annotations

import sys

from kvreuse.bench.engine_bench import machine, markdown
from kvreuse.bench.llamacpp_peer import LlamaCppPeer, describe_exit

SEGFAULT_AT_FIRST_EVAL = """
import json, os, signal, sys
for line in sys.stdin:
    if json.loads(line)["op"] != "load":
        os.kill(os.getpid(), signal.SIGSEGV)
    print(json.dumps({"ok": True}), flush=True)
"""
ERRS = """
import json, sys
for line in sys.stdin:
    print(json.dumps({"error": "ValueError: no model"}), flush=True)
"""


def test_a_worker_killed_by_a_signal_is_a_failure_not_a_crash():
    peer = LlamaCppPeer(threads=1, command=[sys.executable, "-c", SEGFAULT_AT_FIRST_EVAL])
    assert peer.failure is None  # loaded
    assert peer.prefill([1, 2, 3]) is None
    assert peer.failure.startswith("SIGSEGV at prefill")
    assert peer.decode([[1, 2]], 4) is None  # no more calls once failed
    peer.close()


def test_a_worker_that_reports_an_error_fails_with_it():
    peer = LlamaCppPeer(threads=1, command=[sys.executable, "-c", ERRS])
    assert peer.failure == "ValueError: no model at load"
    assert peer.prefill([1]) is None and peer.decode([[1]], 2) is None
    peer.close()


def test_batches_are_not_its_to_serve():
    peer = LlamaCppPeer(threads=1, command=[sys.executable, "-c", SEGFAULT_AT_FIRST_EVAL])
    assert peer.decode([[1], [2]], 4) is None and peer.failure is None  # one sequence per context: no call made
    peer.close()


def test_the_table_names_the_failure():
    report = {"medians": {"kvreuse-fp32": {"prefill_512_tok_s": 900.0}, "llama.cpp": {"prefill_512_tok_s": None}},
              "ratios": {}, "failures": {"llama.cpp": "SIGSEGV at prefill"}, "machine": machine(),
              "gemm_peak_flops": {"fp32": 3e11}, "prefill_fraction_of_peak": {"kvreuse-fp32": {512: 0.41}}}
    table = markdown(report)
    assert "| llama.cpp (failed: SIGSEGV at prefill) | - |" in table
    assert "kvreuse-fp32 prefill at 41% (512 tokens)" in table and "flags:" in table
    assert describe_exit(-11) == "SIGSEGV" and describe_exit(3) == "exit 3"
