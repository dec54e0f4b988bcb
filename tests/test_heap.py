"""trim_heap gives the C heap's free pages back to the OS (engine/heap.py): a freed allocation below glibc's mmap
threshold stays resident until it runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from kvreuse.engine.heap import trim_heap


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(platform.system() != "Linux" or "glibc" not in platform.libc_ver()[0], reason="glibc's malloc_trim")
def test_freed_heap_memory_is_given_back():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(64 << 10) for _ in range(3200)]   # 200 MB in 64 KiB chunks: below the mmap threshold
    for chunk in chunks:
        ctypes.memset(chunk, 1, 64 << 10)
    for chunk in chunks[:-1]:                               # the last one keeps the heap's top from shrinking alone
        libc.free(chunk)
    held = resident_mb()
    assert trim_heap()
    assert resident_mb() < held - 150
    libc.free(chunks[-1])
