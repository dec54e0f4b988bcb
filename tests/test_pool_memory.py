"""The KV pool's memory (kvcache/pool_memory.py): zeros that cost nothing until written, aligned, writable, private."""

import os
import sys

import pytest
import torch

from kvreuse.kvcache.pool_memory import HUGE_PAGE, zeroed


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_pool_is_zero_aligned_and_writable():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool = zeroed((3, 2, 37, 16, 1, 8), dtype, torch.device("cpu"))
        assert pool.shape == (3, 2, 37, 16, 1, 8) and pool.dtype == dtype and pool.is_contiguous()
        assert pool.data_ptr() % HUGE_PAGE == 0
        assert not pool.any()
        pool[1, 0, 5] = 2.5
        assert pool.sum().item() == 2.5 * 16 * 8 and pool[1, 1, 5].abs().sum() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_an_unwritten_pool_is_not_resident():
    before = resident_bytes()
    pool = zeroed((2, 2, 4096, 16, 4, 64), torch.float32, torch.device("cpu"))   # 512 MiB
    assert resident_bytes() - before < 32 * 2**20
    pool[0, 0, :64].fill_(1.0)                                                  # 1 MiB written
    assert resident_bytes() - before < 64 * 2**20
    assert pool[0, 0, :64].sum().item() == 64 * 16 * 4 * 64 and pool[1].abs().sum().item() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_writes_its_own_copy():
    pool = zeroed((2, 2, 64, 16, 2, 8), torch.float32, torch.device("cpu"))
    child = os.fork()
    if child == 0:  # the child writes through numpy (torch's thread pool does not survive a fork), then leaves
        array = pool.numpy()
        array.fill(1.0)
        os._exit(0 if array.sum() == array.size else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert not pool.any()
